"""The checkpoint save in flight: `AsyncSave`, the handle `save_checkpoint(..., blocking=False)`
returns, and the rule that a process has at most one.

[Note: background saves]
An asynchronous save stages what this rank writes to host memory (`_staging`), then a thread
writes it and commits it by the directory protocol (`directory`), as a blocking save would: the
same files, then the manifest, the rename to `step-N` and `latest`. So `latest` never names a
partial checkpoint, and a rank killed mid-write leaves a `.tmp-step-N` that loads refuse and the
next save removes.

The write needs collectives (DCP's plan and metadata, the checksums spread over ranks, the
commit's consensus). They run from the thread on a gloo group of the same ranks made for it
(`distributed.groups.gloo_group`, once per rank set, by every rank of the save in the same
order), never on the training's group: a collective issued from a second thread on the group
the training uses would interleave with the step's, in a different order on each rank (torchtitan
does the same: DCP's `async_save` on a gloo group). Every step of the write reaches one outcome
on every rank (DCP's own error gathering, `_consensus`), so an error is the same on every rank
and no rank is left alone in a collective; it is raised by `wait()`, which the next save or load
calls first: the error surfaces on every rank at the next call, never silently. The
alternative, writing files without collectives and committing at the next call, would leave a
finished checkpoint unnamed by `latest` until then.

A new save (blocking or not) and a load first wait for the one in flight: the new save's step
and pruning act on committed checkpoints only, and the staging buffers are free again. The
thread is a daemon: a process that exits (or is interrupted twice) without waiting abandons
the save, and its previous checkpoint stays `latest`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..distributed.groups import gloo_group
from ..distributed.mesh import ModelRanks
from ._consensus import RankConsensus
from .directory import CheckpointError

Write = Callable[[RankConsensus], Path]
"""The background part of a save: write the staged files and commit them on this consensus."""

_lock = threading.Lock()
_in_flight: AsyncSave | None = None
_gloo: dict[tuple[int, ...], tuple[ProcessGroup, ProcessGroup]] = {}  # ranks: (world, group)


class AsyncSave:
    """A checkpoint being written in the background.

    `step` and `path` (the `step-N` directory it becomes) are known at once; `staged_bytes` is
    the host memory this rank's staged copy holds until the write ends. `done()` says whether
    the write has ended; `wait()` waits for it and returns `path`, or raises `CheckpointError`
    with what the write raised (the same on every rank)."""

    def __init__(self, step: int, path: Path, staged_bytes: int) -> None:
        self.step, self.path, self.staged_bytes = step, path, staged_bytes
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _start(self, write: Write, group: RankConsensus) -> None:
        def run() -> None:
            try:
                write(group)
            except BaseException as e:  # handed to whoever waits
                self._error = e

        self._thread = threading.Thread(target=run, name=f"wholeshard-save-{self.step}")
        self._thread.daemon = True
        self._thread.start()

    def done(self) -> bool:
        """Whether the write has ended, committed or failed (never blocks)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Wait for the write to end; return the checkpoint, or raise `CheckpointError` if it
        failed (nothing of it is then `latest`)."""
        if self._thread is not None:
            self._thread.join()
        _release(self)
        if self._error is not None:
            raise CheckpointError(
                f"the background save of checkpoint {self.path} failed: {self._error}"
            ) from self._error
        return self.path

    def __repr__(self) -> str:
        state = "failed" if self._error else "written" if self.done() else "writing"
        return f"AsyncSave({str(self.path)!r}, {state}, staged_bytes={self.staged_bytes})"


def settle() -> None:
    """Wait for the save in flight, if any; raise its error (`AsyncSave.wait`)."""
    with _lock:
        pending = _in_flight
    if pending is not None:
        pending.wait()


def start(save: AsyncSave, write: Write, ranks: ModelRanks) -> AsyncSave:
    """Run `write` for `save` in the background on a gloo group of `ranks` (every rank of
    `ranks` calls it, after `settle`); `save` is then the one in flight."""
    global _in_flight
    gloo = _gloo_like(ranks.group) if ranks.size > 1 else None
    group = RankConsensus(gloo, ranks.size, ranks.rank)
    with _lock:
        if _in_flight is not None:
            raise RuntimeError("a checkpoint save is already in flight (settle() first)")
        _in_flight = save
    save._start(write, group)
    return save


def _release(save: AsyncSave) -> None:
    global _in_flight
    with _lock:
        if _in_flight is save:
            _in_flight = None


def _gloo_like(group: ProcessGroup | None) -> ProcessGroup:
    """The gloo group of `group`'s ranks (None: the world's), made on first use."""
    world = dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group or world))
    made = _gloo.get(ranks)
    if made is None or made[0] is not world:  # (a new world after destroy_process_group)
        made = _gloo[ranks] = (world, gloo_group(group))
    return made[1]


def _forget_in_child() -> None:
    """A forked child has no save in flight: the thread stayed in the parent."""
    global _in_flight, _lock
    _in_flight, _lock = None, threading.Lock()
    _gloo.clear()


os.register_at_fork(after_in_child=_forget_in_child)
