"""A run's outputs on rank 0: the output directory, `metrics.jsonl`, the progress bar, the
trace, `loss.png`."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from .extras import require


def progress_bar(**kwargs: Any) -> Any:
    """A tqdm bar on stderr, drawn by this process alone. Its lock is a thread lock: tqdm's
    default one holds a multiprocessing semaphore, which a worker ending with `os._exit` (as the
    launcher's do) never unlinks, so Python's resource tracker warned of a leaked semaphore at
    the end of every run."""
    import threading

    from tqdm.auto import tqdm

    tqdm.set_lock(threading.RLock())
    return tqdm(file=sys.stderr, **kwargs)


METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
PLOT = "loss.png"
RUN_FILES = (METRICS, SUMMARY, PLOT)
TRACE_STEPS = 3  # steps recorded by --trace, after one warm-up step


def summary(cfg: Any, progress: dict[str, Any], *, wall_s: float, **run: Any) -> dict[str, Any]:
    """The run summary (summary.json) of a `TrainConfig` run: its progress (`first_val`,
    `last_val`, `last_loss`, `skipped_steps`), its settings, and `run`'s figures."""
    tokens = cfg.optim.steps * cfg.data.batch_size * cfg.data.seq_len
    return {
        "steps": cfg.optim.steps,
        "final_loss": progress["last_loss"],
        "final_val_loss": progress["last_val"],
        "skipped_steps": progress["skipped_steps"],
        "first_val_loss": progress["first_val"],
        "tokens": tokens,
        "wall_s": wall_s,
        "optimizer": cfg.optim.name,
        "matrix_optimizer": cfg.optim.matrix_optimizer if cfg.optim.name == "muon" else None,
        "model": cfg.model.name,
        "seed": cfg.seed,
        "lr": cfg.peak_lr,
        "batch_size": cfg.data.batch_size,
        "seq_len": cfg.data.seq_len,
        "tokens_per_s": tokens / wall_s,
        **run,
    }


def default_out_dir() -> str:
    """`runs/<local timestamp>` under the current directory."""
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def existing_run(out: str | os.PathLike) -> list[str]:
    """The run files already present in `out` (empty if it holds no run)."""
    return [name for name in RUN_FILES if (Path(out) / name).exists()]


def check_out_dir(out: str | os.PathLike, overwrite: bool = False) -> None:
    """Raise ValueError if `out` is not a directory we may write a run into."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    found = existing_run(path)
    if found and not overwrite:
        raise ValueError(
            f"{out} already holds a run ({', '.join(found)}); "
            "pass --overwrite to replace it or choose another --out"
        )


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    return value


def append_event(out: str | os.PathLike, event: dict) -> None:
    """Append an event record (`{"event": name, ...}`, no step) to `out`'s `metrics.jsonl`
    while no worker writes it."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / METRICS, "a") as f:
        f.write(json.dumps({k: _clean(v) for k, v in event.items()}) + "\n")


class RunLog:
    """Rank 0's writer: starts the run directory, appends records, drives the progress bar.

    On other ranks (`enabled=False`) every method is a no-op, so the loop needs no rank checks.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        steps: int,
        enabled: bool,
        progress: bool = True,
        resume_step: int | None = None,
    ):
        """`resume_step`: continue the run in `out`, keeping its records up to that step (and
        its events, such as restarts); `last_logged` is then the last step record it held (the
        previous attempt's last sign of life), if any."""
        self.out = Path(out)
        self.enabled = enabled
        self.records: list[dict] = []
        self.last_logged: dict | None = None
        self._file = None
        self._bar = None
        if not enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and (self.out / METRICS).exists():
            with open(self.out / METRICS) as f:
                kept = [json.loads(line) for line in f if line.strip()]
            self.records = [r for r in kept if "event" in r or r["step"] <= resume_step]
            self.last_logged = next((r for r in reversed(kept) if "event" not in r), None)
        for name in RUN_FILES:  # a run we were allowed to replace or continue: rewrite it
            (self.out / name).unlink(missing_ok=True)
        self._file = open(self.out / METRICS, "w")
        for rec in self.records:
            self._file.write(json.dumps(rec) + "\n")
        if progress:
            require("tqdm")
            self._bar = progress_bar(total=steps, desc="train", unit="step", leave=True)

    def record(self, rec: dict) -> None:
        """Append one record to `metrics.jsonl` and show it on the progress bar."""
        if not self.enabled:
            return
        rec = {k: _clean(v) for k, v in rec.items()}
        self.records.append(rec)
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._bar is not None:
            shown = {}
            if rec.get("loss") is not None:
                shown["loss"] = f"{rec['loss']:.3f}"
            val = next((r["val_loss"] for r in reversed(self.records) if "val_loss" in r), None)
            if val is not None:
                shown["val"] = f"{val:.3f}"
            if rec.get("tokens_per_s"):
                shown["tok/s"] = f"{rec['tokens_per_s']:.0f}"
            self._bar.set_postfix(shown, refresh=False)
            self._bar.n = rec["step"]
            self._bar.refresh()

    def event(self, rec: dict) -> None:
        """Append an event record (`{"event": name, ...}`) to `metrics.jsonl`."""
        if self.enabled:
            rec = {k: _clean(v) for k, v in rec.items()}
            self.records.append(rec)
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def note(self, text: str) -> None:
        """Print a line for the user on stderr (above the progress bar)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def write_json(self, name: str, obj: dict) -> None:
        """Write `obj` as `out/name` (pretty JSON)."""
        if self.enabled:
            (self.out / name).write_text(json.dumps(obj, indent=2) + "\n")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None


def start_trace(path: str | None, rank: int, cuda: bool) -> Any:
    """A started torch.profiler that writes a Chrome trace to `path` (rank 0) after a few
    steps, or None without a `path`."""
    if path is None:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    def write(prof: Any) -> None:
        if rank == 0:
            prof.export_chrome_trace(path)

    activities = [ProfilerActivity.CPU]
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    prof = profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=TRACE_STEPS, repeat=1),
        on_trace_ready=write,
    )
    prof.start()
    return prof


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
