"""The run's checkpoints (`RunCheckpoints`): what a save holds besides the training state, saves
in the background by default (`checkpoint.blocking` for foreground ones), and a resume.

A background save (`wholeshard.checkpoint.AsyncSave`) returns once every rank has copied what
it writes to host memory, and training steps on while it is written; the next save waits for
it first (`save_checkpoint` does), and so does the end of the run, before the summary: a run
that ends has its last checkpoint complete. A run that fails or is stopped waits for the save
in flight too, so the checkpoint it was writing still becomes the one a resume starts from. The
first Ctrl-C of `wholeshard train` stops every rank after the same step ([Note: stopping at a
step] in `wholeshard.distributed.stop`), starting no new save, and so finishes the save in
flight (`latest` then names it); a second stops every process at once, abandoning it: the
previous checkpoint stays `latest`, and the next save removes the partial `.tmp-step-N`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from . import outputs
from .config import TrainConfig
from .lr_schedule import adopt_schedule
from .model import JobModel
from .newton_schulz import NewtonSchulz
from .resume import newton_schulz_warning


class RunCheckpoints:
    """Save and resume the run of `cfg`: `module` (the wrapper), `opt`, `scheduler`, RNG, data
    position and progress; `saving` is the save being written in the background, if any."""

    def __init__(
        self,
        cfg: TrainConfig,
        module: nn.Module,
        opt: torch.optim.Optimizer,
        scheduler: LambdaLR,
        newton_schulz: NewtonSchulz | None,
        job: JobModel,
    ) -> None:
        self.cfg, self.module, self.opt, self.scheduler = cfg, module, opt, scheduler
        self.newton_schulz, self.job = newton_schulz, job
        self.saving: Any = None

    def save(self, step: int, progress: dict[str, Any]) -> None:
        """Checkpoint the run at `step`; `progress` (validation losses, the last training loss,
        skipped steps) travels in the checkpoint's `extra`. Returns once it is written, or (by
        default) once it is staged, leaving it to write in the background."""
        from ..checkpoint import save_checkpoint

        extra = {
            "step": step,
            "scheduler": self.scheduler.state_dict(),
            "schedule": self.cfg.lr_schedule,
            "rng": torch.get_rng_state(),
            "newton_schulz": self.newton_schulz and self.newton_schulz.name,
            **progress,
        }
        if self.job.export is not None:  # for `wholeshard export --format hf`
            extra["hf"] = self.job.export
        ckpt = self.cfg.checkpoint
        saved = save_checkpoint(
            self.cfg.checkpoint_dir,
            self.module,
            self.opt,
            extra=extra,
            keep_last=ckpt.keep_last,
            blocking=ckpt.blocking,
        )
        self.saving = None if ckpt.blocking else saved

    def wait(self, log: outputs.RunLog | None = None) -> None:
        """Wait for the checkpoint being written in the background, if any. With `log` (the run
        is failing or stopping already), say so while it waits, and a failed save is a note
        there rather than a second error."""
        saving, self.saving = self.saving, None
        if saving is None:
            return
        if log is not None and not saving.done():
            log.note(f"wholeshard train: finishing the checkpoint of step {saving.step}")
        try:
            saving.wait()
        except Exception as e:
            if log is None:
                raise
            log.note(f"wholeshard train: {e}")

    def resume(self, path: os.PathLike) -> dict[str, Any]:
        """Load checkpoint `path` into the model, optimizer and scheduler; returns its `extra`
        (with `path`, and `warnings` where this run's schedule settings differ from the saved
        ones, which it follows from the next step, or its Newton-Schulz does). The data position
        is the step: batch `s` is a pure function of (seed, s, rank, world)."""
        from ..checkpoint import load_checkpoint

        extra = load_checkpoint(path, self.module, self.opt)
        self.scheduler.load_state_dict(extra["scheduler"])  # keeps this run's lr function
        torch.set_rng_state(extra["rng"])
        schedule = extra.get("schedule"), self.cfg.lr_schedule, extra["step"]
        warnings = [adopt_schedule(self.scheduler, *schedule)]
        warnings.append(newton_schulz_warning(extra.get("newton_schulz"), self.newton_schulz))
        return dict(extra, path=str(path), warnings=[w for w in warnings if w is not None])
