"""`loss.png`: train and validation loss against step."""

from __future__ import annotations

import os

from .extras import require


def plot_losses(records: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """Draw train loss (every logged step) and validation loss (evaluation steps) to `path`."""
    require("matplotlib")
    from matplotlib.figure import Figure  # drawn with Agg by savefig, without pyplot

    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig = Figure(figsize=(7, 4.5), dpi=110)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train, strict=True), lw=1, alpha=0.8, label="train")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
