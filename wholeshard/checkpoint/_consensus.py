"""Rank consensus: every rank of a save or load reaches the same outcome.

A step that may fail runs either on rank 0 alone (`on_first`: it touches shared files) or on
every rank (`all_succeed`: each checks its share); either way every rank then returns the same
result or raises `CheckpointError` with the same message, so no rank goes on into a collective
the others have left, and a failed load changes nothing on any rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

from .directory import CheckpointError

T = TypeVar("T")


class RankConsensus:
    """The collectives a save or load needs, on the `size` ranks of `pg` (this one `rank`);
    local when `size` is 1."""

    def __init__(self, pg: ProcessGroup | None, size: int, rank: int) -> None:
        self.pg, self.size, self.rank = pg, size, rank
        self.distributed = size > 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        src = 0 if self.pg is None else dist.get_global_rank(self.pg, 0)
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.pg)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def on_first(self, fn: Callable[[], T], what: str) -> T:
        """Run `fn` on rank 0 only; every rank returns its result or raises its error."""
        result, error = self.broadcast(_attempt(fn, what) if self.rank == 0 else None)
        if error is not None:
            raise CheckpointError(error)
        return result

    def all_succeed(self, fn: Callable[[], T], what: str) -> T:
        """Run `fn` on every rank; if any rank fails, every rank raises all their errors."""
        result, error = _attempt(fn, what)
        distinct = list(dict.fromkeys(e for e in self.all_gather(error) if e is not None))
        if distinct:
            raise CheckpointError(" | ".join(distinct))
        return result


def _attempt(fn: Callable[[], T], what: str) -> tuple[T | None, str | None]:
    """`fn()` and no error, or None and what went wrong (a CheckpointError's own message)."""
    try:
        return fn(), None
    except CheckpointError as e:
        return None, str(e)
    except Exception as e:
        return None, f"{what}: {type(e).__name__}: {e}"
