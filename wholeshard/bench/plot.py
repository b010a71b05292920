"""`--png`: bar charts of step time and memory per configuration."""

from __future__ import annotations

from .report import Row

_PANELS = (
    (
        "median step time (s)",
        1.0,
        (("step_s", "step", "tab:blue"), ("floor_s", "floor (floor.py)", "tab:purple")),
    ),
    (
        "peak RSS per rank (MB)",
        1e6,
        (
            ("peak_rss_bytes", "peak RSS", "tab:gray"),
            ("peak_rss_delta_bytes", "delta from before the model", "tab:green"),
        ),
    ),
    ("optimizer state per rank (MB)", 1e6, (("optimizer_state_bytes", None, "tab:orange"),)),
)
"""(title, unit, bars): each bar series is (Row field, legend label or None, colour); a panel's
series are drawn side by side, a figure a row lacks (None) as no bar."""


def write_png(rows: list[Row], path: str, title: str) -> None:
    """One row of panels per workload: step time, peak resident memory (and its growth from
    building the model on), optimizer state."""
    from matplotlib.figure import Figure  # drawn with Agg by savefig, without pyplot

    workloads = list(dict.fromkeys(r.workload for r in rows))
    fig = Figure(figsize=(15, 3.8 * len(workloads)))
    axes = fig.subplots(len(workloads), len(_PANELS), squeeze=False)
    for panels, workload in zip(axes, workloads, strict=True):
        done = [r for r in rows if r.workload == workload and r.error is None]
        xs = list(range(len(done)))
        for ax, (label, scale, series) in zip(panels, _PANELS, strict=True):
            width = 0.8 / len(series)
            for i, (field, legend, color) in enumerate(series):
                values = [getattr(r, field) for r in done]
                heights = [float("nan") if v is None else v / scale for v in values]
                offset = (i - (len(series) - 1) / 2) * width
                ax.bar([x + offset for x in xs], heights, width, color=color, label=legend)
            if len(series) > 1:
                ax.margins(y=0.25)  # room above the bars for the legend
                ax.legend(fontsize="small", loc="upper center", ncol=len(series))
            ax.set_title(f"{workload}: {label}", fontsize="medium")
            ax.set_xticks(xs)
            ax.set_xticklabels([r.config for r in done], rotation=25, ha="right", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
