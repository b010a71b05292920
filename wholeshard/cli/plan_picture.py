"""`wholeshard plan --png`: a plan drawn as bars of shards coloured by owner (matplotlib, imported
when drawing)."""

from __future__ import annotations

from typing import Any

from ..planning import Buffer, Plan


def draw_png(plan: Plan, path: str) -> None:
    """Draw each buffer as a bar of its shards coloured by owning rank, padding in grey."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, Normalize
    from matplotlib.figure import Figure  # drawn with Agg by savefig, without pyplot
    from matplotlib.patches import Patch

    k = plan.shard_group_size
    if k <= 20:  # one distinct colour per rank
        cmap: Any = ListedColormap(colormaps["tab10" if k <= 10 else "tab20"].colors[:k])
    else:
        cmap = colormaps["turbo"]
    colours = ScalarMappable(norm=Normalize(vmin=-0.5, vmax=k - 0.5), cmap=cmap)
    fig = Figure(figsize=(12, 0.6 + 1.3 * len(plan.buffers)), layout="constrained")
    axes = fig.subplots(max(1, len(plan.buffers)), 1, squeeze=False)[:, 0]
    for ax, (index, buffer) in zip(axes, enumerate(plan.buffers), strict=False):
        shards, owners = [], []
        for b in buffer.buckets:
            for r, lo, hi in b.shards():  # an owner bucket's non-empty shards
                shards.append((lo, hi - lo))
                owners.append(r)
        ax.broken_barh(shards, (0, 1), facecolors=colours.to_rgba(owners), linewidth=0)
        ax.broken_barh(_gaps(buffer), (0, 1), facecolors="0.85", hatch="////", linewidth=0)
        ax.vlines([b.start for b in buffer.buckets[1:]], 0, 1, colors="black", linewidth=0.6)
        ax.set_xlim(0, max(buffer.numel, 1))
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_xlabel("buffer element")
        ax.set_title(
            f"buffer {index}: {buffer.kind} ({buffer.sharding}), {buffer.numel:,} elements, "
            f"{len(buffer.buckets)} bucket(s), padding {1 - buffer.used / buffer.numel:.2%}",
            fontsize=9,
            loc="left",
        )
    bar = fig.colorbar(colours, ax=list(axes), label="owner (rank in shard group)", pad=0.01)
    if k <= 20:
        bar.set_ticks(range(k))
    fig.legend(
        handles=[Patch(facecolor="0.85", hatch="////", label="padding")],
        loc="outside lower right",
        fontsize=8,
    )
    fig.suptitle(
        f"dp {plan.dp_size}, shard groups of {k}, {plan.strategy}: padding "
        f"{plan.padding_fraction:.3%}, Newton-Schulz imbalance {plan.ns_cost_imbalance:.3f}",
        fontsize=10,
    )
    fig.savefig(path, dpi=100)


def _gaps(buffer: Buffer) -> list[tuple[int, int]]:
    """(start, length) of every buffer range no param covers."""
    gaps = []
    cursor = 0
    for start, end in sorted((p.start, p.end) for p in buffer.placements):
        if start > cursor:
            gaps.append((cursor, start - cursor))
        cursor = max(cursor, end)
    if buffer.numel > cursor:
        gaps.append((cursor, buffer.numel - cursor))
    return gaps
