"""A run that continues at another world size: `WorldChange`, found at resume, said in the
restarted attempt's header and recorded in `metrics.jsonl` once its first step is done.

Under torchrun's elastic mode (`--nnodes=MIN:MAX`, docs/operations.md) a lost node, or a node
that joins, restarts every worker with the world the rendezvous found; `--resume auto` resumes
from the latest checkpoint, which holds the world size of the run that saved it (in its `extra`,
`WORLD_SIZE`). The global batch and its order stay the job's (`wholeshard.train.batch`), so only
the split changes. The record measures the restart: from the last step the previous attempt
logged (its `time`; the loss came after it, within `output.log_every` steps) to the end of the
first step at the new size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .batch import BatchSplit

WORLD_SIZE = "world_size"
"""The key of a checkpoint's `extra` (and of the run's progress) naming the world that saved it."""
EVENT = "world_size"
"""The `event` of the `metrics.jsonl` record of a change."""


@dataclass(frozen=True)
class WorldChange:
    """The run resumed at step `resume_step` with `after` ranks from a checkpoint saved by
    `before`; `split` is the batch's split now, `last_logged` the last step record the previous
    attempt wrote (None: none)."""

    before: int
    after: int
    resume_step: int
    split: BatchSplit
    last_logged: dict[str, Any] | None

    def note(self) -> str:
        """The header line: the sizes, the new split, the global batch unchanged."""
        return (
            f"wholeshard train: world size {self.before} -> {self.after} (the checkpoint of step "
            f"{self.resume_step} was saved by {self.before} rank(s)); the global batch and its "
            f"order are unchanged: {self.split.describe()}"
        )

    def event(self, first_step: int) -> dict[str, Any]:
        """The `metrics.jsonl` record, written once `first_step` (the first at the new size) is
        done: `since_last_step_s` is the time from the previous attempt's last logged step."""
        now = time.time()
        last = self.last_logged or {}
        since = now - last["time"] if "time" in last else None
        return {
            "event": EVENT,
            "from": self.before,
            "to": self.after,
            "resume_step": self.resume_step,
            "first_step": first_step,
            "last_logged_step": last.get("step"),
            "since_last_step_s": since,
            "batch_size": self.split.batch_size,
            "per_rank": self.split.per_rank,
            "accumulation": self.split.accumulation,
            "time": now,
        }


def world_change(
    saved: dict[str, Any], world: int, split: BatchSplit, last_logged: dict[str, Any] | None
) -> WorldChange | None:
    """The change from checkpoint `extra` `saved` (resumed) to `world` ranks, or None: the same
    size, or a checkpoint that did not record its world."""
    before = saved.get(WORLD_SIZE)
    if not isinstance(before, int) or before == world:
        return None
    return WorldChange(before, world, saved["step"], split, last_logged)
