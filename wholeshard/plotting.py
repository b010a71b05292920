"""A matplotlib figure to draw into and save: the one way wholeshard's commands plot.

A `Figure` on the Agg canvas, without pyplot: no process-wide backend switch, no figure
registry to leak into, works headless. matplotlib is imported on first use; callers decide what
a missing matplotlib means for them.
"""

from __future__ import annotations

from typing import Any


def figure(**kwargs: Any) -> Any:
    """A new `matplotlib.figure.Figure(**kwargs)` (e.g. `figsize`, `layout`) that `savefig`
    renders with Agg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig
