"""`WaitTimer`: how long the training is held up by the collectives it waits for.

On the CPU a wait blocks the host, so the host's wall time inside it is the cost. On CUDA,
NCCL's `wait()` returns at once: it makes the current stream wait for the collective, and the
hold-up is the time that stream then idles. So each wait is timed on both clocks: the host's,
and a pair of CUDA events recorded on the current stream around it; it counts as the larger of
the two (gloo on CUDA tensors blocks the host instead of the stream). Events are read when
`seconds` is asked for: that waits for the last recorded one to complete (a host sync, at the
caller's chosen time, never inside a step).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

_PENDING_LIMIT = 4096  # event pairs kept unread before the completed ones are folded in


class WaitTimer:
    """Seconds held up by waits on collectives, over the tensors of `device`."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._seconds = 0.0
        self._pending: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        """Count the time spent inside as held up by collectives."""
        if self._cuda:
            before = torch.cuda.Event(enable_timing=True)
            before.record()
        start = time.perf_counter()
        try:
            yield
        finally:
            host = time.perf_counter() - start
            if self._cuda:
                after = torch.cuda.Event(enable_timing=True)
                after.record()
                self._pending.append((host, before, after))
                if len(self._pending) > _PENDING_LIMIT:
                    self._fold(only_completed=True)
            else:
                self._seconds += host

    @property
    def seconds(self) -> float:
        """Total seconds so far (on CUDA: waits for the recorded events)."""
        self._fold(only_completed=False)
        return self._seconds

    def _fold(self, only_completed: bool) -> None:
        left = []
        for host, before, after in self._pending:
            if not after.query():
                if only_completed:
                    left.append((host, before, after))
                    continue
                after.synchronize()
            self._seconds += max(host, before.elapsed_time(after) / 1000.0)
        self._pending = left
