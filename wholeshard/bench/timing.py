"""Stamps and the seconds between them, on the device a rank computes on.

On CPU a stamp is `time.perf_counter()`. On CUDA the host runs ahead of the GPU, so a stamp is a
`torch.cuda.Event` recorded on the current stream and the seconds between two stamps are the
GPU's (`Event.elapsed_time`): reading them waits for the later event, so the caller reads a
step's intervals after the step, and the host does not run ahead into the next one.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class Timer:
    """`stamp()` now; `seconds(start, end)` between two stamps of this timer."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def max_memory_allocated(device: torch.device) -> int | None:
    """`torch.cuda.max_memory_allocated` of this process on `device` (bytes), None on CPU."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
