"""Per-process memory figures: resident set (peak and current), optimizer-state bytes, and the
persistent bytes a `DataParallel` reports holding between steps."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch

PERSISTENT_KINDS = ("params", "grads", "masters", "optimizer_state")
"""The kinds of `DataParallel.memory()` a rank keeps between steps (its other keys, such as
`transient_unit`, exist only during forward/backward)."""


def _proc_status_bytes(key: str) -> int | None:
    """A `kB` figure of /proc/self/status (e.g. `VmRSS`) in bytes; None without procfs."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes.

    On Linux this is `VmHWM` from /proc/self/status: `getrusage(...).ru_maxrss` of a spawned
    worker starts at its launcher's peak (the kernel carries the old address space's high-water
    mark across `exec`), so it would report the launcher's memory, not the worker's.
    """
    peak = _proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def rss_bytes() -> int | None:
    """This process's current resident set size in bytes (`VmRSS`); never above the peak that
    `peak_rss_bytes` reports afterwards. None without procfs (not Linux)."""
    return _proc_status_bytes("VmRSS")


def persistent_bytes(memory: Mapping[str, int]) -> int:
    """The bytes of a `DataParallel.memory()` breakdown that outlive a step (`PERSISTENT_KINDS`)."""
    return sum(memory[kind] for kind in PERSISTENT_KINDS)


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of every tensor held in the optimizers' `state` on this rank (each storage once)."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def visit(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            to_local = getattr(value, "to_local", None)  # a DTensor: count this rank's shard only
            t = to_local() if callable(to_local) else value
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        elif isinstance(value, (dict, list, tuple)):
            for v in value.values() if isinstance(value, dict) else value:
                visit(v)

    for opt in optimizers:
        for per_param in opt.state.values():
            visit(per_param)
    return total
