"""`--png`: bar charts of step time and memory per configuration (matplotlib, imported lazily)."""

from __future__ import annotations

from .report import Row

_PANELS = (
    ("step_s", 1.0, "median step time (s)", "tab:blue"),
    ("peak_rss_bytes", 1e6, "peak RSS per rank (MB)", "tab:gray"),
    ("optimizer_state_bytes", 1e6, "optimizer state per rank (MB)", "tab:orange"),
)


def write_png(rows: list[Row], path: str, title: str) -> None:
    """One row of panels per workload: step time, peak resident memory, optimizer state."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in rows))
    fig, axes = plt.subplots(
        len(workloads), len(_PANELS), figsize=(15, 3.8 * len(workloads)), squeeze=False
    )
    for panels, workload in zip(axes, workloads, strict=True):
        done = [r for r in rows if r.workload == workload and r.error is None]
        xs = list(range(len(done)))
        for ax, (field, scale, label, color) in zip(panels, _PANELS, strict=True):
            ax.bar(xs, [getattr(r, field) / scale for r in done], color=color)
            ax.set_title(f"{workload}: {label}", fontsize="medium")
            ax.set_xticks(xs)
            ax.set_xticklabels([r.config for r in done], rotation=25, ha="right", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
