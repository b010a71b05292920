"""Seconds a rank spends blocked on collectives, gathered from every place Python can see a block.

Blocked time is the wall time the training thread spends inside a collective call (dispatch
included: gloo's reduce-scatter clones the whole input before it returns) or waiting on a
collective's handle. `WaitClock.watch()` patches, inside one worker process:
- the `torch.distributed` collectives (a synchronous call blocks until the collective is done:
  FSDP2's all-gathers and reduce-scatters on CPU, the all-gathers in `MuonWithAuxAdam.step`);
- every function of `wholeshard.distributed.collectives` (all of wholeshard's dispatches and waits);
- `Work.wait` (waits on async handles issued from Python);
- `torch.distributed._functional_collectives.wait_tensor` (DTensor redistributions, e.g. what
  `torch.optim.Muon` triggers on FSDP2's sharded params).

DDP's C++ reducer waits out of Python's sight: its configurations book the backward tail through
`add` (see `builders.py`). Nested blocks (a `Work.wait` inside `collectives.wait`) count once, and
only blocks on the thread that made the clock count.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..distributed import collectives

_TORCH_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
)


class WaitClock:
    """Accumulates blocked seconds on the thread that created it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._thread = threading.get_ident()

    def add(self, seconds: float) -> None:
        """Count `seconds` measured elsewhere (e.g. a comm hook's timestamps)."""
        self.seconds += max(0.0, seconds)

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """Count the wall time of the block, unless an enclosing block already does."""
        if threading.get_ident() != self._thread:
            yield
            return
        self._depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.seconds += time.perf_counter() - start

    @contextmanager
    def watch(self) -> Iterator[WaitClock]:
        """Patch the blocking entry points (module note) for the duration of the context."""
        patches: list[tuple[Any, str, Any]] = []

        def patch(owner: Any, name: str) -> None:
            """Count every call of `owner.name` as blocked."""
            original = getattr(owner, name)

            @functools.wraps(original)
            def timed(*args: Any, **kwargs: Any) -> Any:
                with self.blocked():
                    return original(*args, **kwargs)

            patches.append((owner, name, original))
            setattr(owner, name, timed)

        for name in _TORCH_COLLECTIVES:
            if hasattr(dist, name):
                patch(dist, name)
        for name, fn in list(vars(collectives).items()):
            if inspect.isfunction(fn) and fn.__module__ == collectives.__name__:
                patch(collectives, name)
        patch(dist.Work, "wait")
        patch(funcol, "wait_tensor")
        try:
            yield self
        finally:
            for owner, name, original in reversed(patches):
                setattr(owner, name, original)
