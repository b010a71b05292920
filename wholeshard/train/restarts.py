"""`--max-restarts`: run the job on local workers and, when one fails, relaunch it from the
latest checkpoint (torchrun's `--max-restarts`, for `wholeshard.distributed.launch`).

A failure stops every worker (the launcher guarantees that); the relaunched job resumes from
`<out>/checkpoints`' latest complete checkpoint, which restores params, optimizer state, the
learning-rate schedule and the RNG, and the data position is the step, so the run continues
bit for bit as if uninterrupted. Each restart is one line on stderr and one `restart` event in
`metrics.jsonl`. The job checkpoints step 0 when restarts are allowed, so every restart
resumes from a checkpoint; only a failure before that (e.g. while loading the data) starts
over, and its event is then on stderr only (a fresh start rewrites `metrics.jsonl`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable

from ..distributed import stop
from ..distributed.launch import WorkerFailed
from . import outputs
from .config import TrainConfig
from .trainer import train


def train_local(
    cfg: TrainConfig, nproc: int, worker: Callable[[TrainConfig], dict] = train
) -> dict:
    """Run `worker(cfg)` on `nproc` local workers, restarting up to `max_restarts` times;
    returns rank 0's summary. Raises the last `WorkerFailed` when no restart is left, or once the
    job was asked to stop (a first Ctrl-C: `wholeshard.distributed.stop`)."""
    from ..distributed.launch import launch  # looked up per call: tests replace it

    restarts = 0
    while True:
        try:
            timeout = cfg.reliability.collective_timeout
            return launch(worker, nproc, args=(cfg,), collective_timeout_s=timeout)[0]
        except WorkerFailed as failure:
            if restarts == cfg.reliability.max_restarts or stop.requested():
                raise
            restarts += 1
            cfg = _relaunch_config(cfg, failure, restarts)


def _relaunch_config(cfg: TrainConfig, failure: WorkerFailed, restart: int) -> TrainConfig:
    """Log restart number `restart` and return the config that resumes the run."""
    from ..checkpoint.directory import CheckpointError, resolve_checkpoint, step_of

    try:
        ckpt = resolve_checkpoint(cfg.checkpoint_dir)
    except CheckpointError:  # failed before its first checkpoint: start again
        ckpt = None
    lines = failure.traceback.strip().splitlines() or [""]
    reason = lines[-1] if lines[0].startswith("Traceback") else lines[0]  # exception or exit code
    step = None if ckpt is None else step_of(ckpt)
    print(
        f"wholeshard train: worker rank {failure.rank} failed ({reason}); all workers stopped. "
        f"Restart {restart}/{cfg.reliability.max_restarts} from "
        f"{'the start (no checkpoint yet)' if ckpt is None else ckpt}.",
        file=sys.stderr,
        flush=True,
    )
    event = {
        "event": "restart",
        "restart": restart,
        "max_restarts": cfg.reliability.max_restarts,
        "failed_rank": failure.rank,
        "reason": reason,
        "resume_step": step,
        "time": time.time(),
    }
    outputs.append_event(cfg.output.out, event)
    resume = None if ckpt is None else str(ckpt)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=resume))
