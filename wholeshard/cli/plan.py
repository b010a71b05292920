"""`wholeshard plan`: plan the buffers of a model given by shapes alone, and show the plan.

    wholeshard plan (--shapes FILE.json | --preset NAME) --dp N [--bucket-size N]
                      [--strategy S] [--shard-group-size K] [--json] [--png FILE]

A shapes file is `{"params": [{"name": str, "shape": [int, ...], "muon": bool, "tied": bool},
...]}` in registration order; `muon` and `tied` are optional (`tied` defaults to false, `muon`
to `routing.muon_by_name`). Exit codes: 0 planned, 2 bad input (argparse errors, an unreadable
or malformed shapes file, a model no torch process could hold, a model no plan can serve).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..planning import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    Buffer,
    ParamSpec,
    Plan,
    default_bucket_size,
    plan_buffers,
)
from ..planning.presets import PRESETS
from ..planning.shapes import load_shapes
from ..planning.specs import matrices
from . import positive_int

MAX_DP = 1 << 20
"""Largest `--dp`: beyond any cluster, and the plan keeps per-rank tables."""


def plan_json(plan: Plan, specs: Sequence[ParamSpec], seconds: float) -> dict[str, Any]:
    """The `--json` document: plan summary, buffers with their buckets, and the params in the
    order of `specs` (the specs `plan` was planned from)."""
    where = {p.name: (i, p) for i, b in enumerate(plan.buffers) for p in b.placements}
    params = []
    for spec in specs:
        index, p = where[spec.name]
        buffer = plan.buffers[index]
        entry = {
            "name": p.name,
            "shape": list(p.shape),
            "kind": buffer.kind,
            "buffer": index,
            "bucket": p.bucket,
            "start": p.start,
            "end": p.end,
            "owner": p.owner,
        }
        if buffer.kind == "stacked":  # the owner of each matrix, in order
            entry["matrix_owners"] = [m.owner for m in matrices(p, buffer.buckets)]
        params.append(entry)
    return {
        "dp": plan.dp_size,
        "strategy": plan.strategy,
        "shard_group_size": plan.shard_group_size,
        "bucket_size": plan.bucket_size,
        "padding_fraction": plan.padding_fraction,
        "ns_cost_imbalance": plan.ns_cost_imbalance,
        "plan_seconds": seconds,
        "buffers": [
            {
                "kind": b.kind,
                "numel": b.numel,
                "buckets": [
                    {"start": c.start, "end": c.end, "shard_numel": c.shard_numel}
                    for c in b.buckets
                ],
            }
            for b in plan.buffers
        ],
        "params": params,
    }


def plan_table(plan: Plan, seconds: float, source: str) -> str:
    """A readable summary and one line per bucket of every buffer."""
    k, dp = plan.shard_group_size, plan.dp_size
    n_params = sum(len(b.placements) for b in plan.buffers)
    used = sum(b.used for b in plan.buffers)
    costs = plan.rank_costs()
    lines = [
        f"{source}: {n_params:,} params, {used:,} elements; dp {dp} = {dp // k} shard group(s) "
        f"of {k} ranks; strategy {plan.strategy}; buckets of >= {plan.bucket_size:,} elements; "
        f"planned in {seconds:.3f} s",
        f"padding {plan.padding_fraction:.3%} ({plan.numel - used:,} of {plan.numel:,} "
        f"elements); Newton-Schulz cost per rank min/mean/max {min(costs):.3g} / "
        f"{sum(costs) / k:.3g} / {max(costs):.3g}, imbalance {plan.ns_cost_imbalance:.3f}",
    ]
    header = (
        f"  {'bucket':>6} {'start':>17} {'end':>17} {'shard_numel':>15} {'params':>7} "
        f"{'padding':>8}  largest param"
    )
    for index, buffer in enumerate(plan.buffers):
        lines += [
            "",
            f"buffer {index} ({buffer.kind}, {buffer.sharding}): {buffer.numel:,} elements in "
            f"{len(buffer.buckets)} bucket(s)",
            header,
        ]
        members: list[list[Any]] = [[0, 0, None] for _ in buffer.buckets]  # count, used, widest
        for p in buffer.placements:
            for i in buffer.buckets_of(p):  # a stack may spread over several buckets
                b, m = buffer.buckets[i], members[i]
                m[0] += 1
                m[1] += min(p.end, b.end) - max(p.start, b.start)
                if m[2] is None or p.numel > m[2].numel:
                    m[2] = p
        for b, (count, bucket_used, widest) in zip(buffer.buckets, members, strict=True):
            shape = "x".join(map(str, widest.shape)) or "scalar"
            lines.append(
                f"  {b.index:>6} {b.start:>17,} {b.end:>17,} {b.shard_numel:>15,} {count:>7} "
                f"{1 - bucket_used / b.numel:>8.2%}  {widest.name} ({shape})"
            )
    return "\n".join(lines)


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
            for r in range(k):
                shards.append((b.start + r * b.shard_numel, b.shard_numel))
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `wholeshard plan`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--shapes",
        metavar="FILE.json",
        help='{"params": [{"name", "shape", optional "muon", "tied"}, ...]} in registration order',
    )
    source.add_argument("--preset", choices=sorted(PRESETS), help="a published model's shapes")
    parser.add_argument(
        "--dp", type=positive_int(MAX_DP), required=True, metavar="N", help="data-parallel ranks"
    )
    parser.add_argument(
        "--bucket-size",
        type=positive_int(),
        default=None,
        metavar="N",
        help="elements per bucket, at least (default: what DataParallel takes, "
        "default_bucket_size: about 1/8 of the params, at least 65,536, at most "
        "max(40M, 1M x dp))",
    )
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=DEFAULT_STRATEGY,
        help=f"how Muon matrices are dealt to ranks (default {DEFAULT_STRATEGY})",
    )
    parser.add_argument(
        "--shard-group-size",
        type=positive_int(),
        default=None,
        metavar="K",
        help="shard params within groups of K ranks, replicated across the dp/K groups; "
        "K divides N (default N)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument(
        "--png", metavar="FILE", help="draw each buffer's shards, coloured by owner, to FILE"
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `wholeshard plan` on the `wholeshard` subcommand parsers."""
    parser = subparsers.add_parser(
        "plan",
        help="plan the buffers of a model given by shapes, and show the plan",
        description="Plan whole-tensor (Muon) and element-wise (AdamW) buffers for a model "
        "given by a shapes file or a preset, without building it, and report padding, "
        "Newton-Schulz cost balance and every param's placement.",
    )
    add_arguments(parser)
    parser.set_defaults(run=main)
    return parser


def main(args: argparse.Namespace) -> int:
    """Run `wholeshard plan` with parsed `args`; return the exit code."""
    try:
        if args.shapes is not None:
            specs, source = load_shapes(args.shapes), args.shapes
        else:
            specs, source = PRESETS[args.preset](), args.preset
        bucket_size = args.bucket_size
        if bucket_size is None:
            bucket_size = default_bucket_size(sum(s.numel for s in specs), args.dp)
        start = time.perf_counter()
        plan = plan_buffers(
            specs,
            args.dp,
            bucket_size=bucket_size,
            strategy=args.strategy,
            shard_group_size=args.shard_group_size,
        )
        seconds = time.perf_counter() - start
    except ValueError as e:  # ShapesError, or inputs no plan can serve
        print(f"wholeshard plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(json.dumps(plan_json(plan, specs, seconds), allow_nan=False) + "\n")
    else:
        print(plan_table(plan, seconds, source))
    if args.png is not None:
        try:
            draw_png(plan, args.png)
        except ImportError:
            print(
                "wholeshard plan: error: --png needs matplotlib (pip install matplotlib)",
                file=sys.stderr,
            )
            return 2
        except OSError as e:
            print(f"wholeshard plan: error: cannot write {args.png!r}: {e}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"\nwrote {args.png}")
    return 0
