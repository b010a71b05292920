"""Per-process memory figures: peak resident set and optimizer-state bytes."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from typing import Any

import torch


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes.

    On Linux this is `VmHWM` from /proc/self/status: `getrusage(...).ru_maxrss` of a spawned
    worker starts at its launcher's peak (the kernel carries the old address space's high-water
    mark across `exec`), so it would report the launcher's memory, not the worker's.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: count this rank's shard only
    return to_local() if callable(to_local) else t


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of every tensor held in the optimizers' `state` on this rank (each storage once)."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def visit(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            t = _local(value)
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    for opt in optimizers:
        for per_param in opt.state.values():
            visit(per_param)
    return total
