"""Staging: a copy in host memory of everything one rank writes, so that a background write
reads values that the next optimizer step cannot change.

`stage(entries)` copies every chunk of a rank's `Chunks` (its owned params, fp32 masters and
optimizer state, rank 0's buffers) to a new host tensor of the chunk's shape and strides (what
DCP's writer would make of the chunk itself, so the files hold the same bytes either way).
Staging is synchronous: it returns once the copies are complete, so the next step needs no wait.
From an accelerator the copies go to pinned memory (fast copies; torchtitan's
`async_with_pinned_mem`), and those buffers are kept and reused by the next save of the same
layout, since pinning is slow; on the CPU each save allocates its copies and frees them once
written. At most one save is in flight (`_pending`), so a reused buffer is never still being
written.
"""

from __future__ import annotations

import torch

from ._chunks import Chunks

_Layout = tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]
_pinned: tuple[_Layout, list[torch.Tensor]] | None = None  # the last pinned staging buffers


def stage(entries: dict[str, Chunks]) -> tuple[dict[str, Chunks], int]:
    """A host copy of `entries` and the bytes it holds."""
    sources = [t for chunks in entries.values() for _, t in chunks.parts]
    on_device = any(t.device.type != "cpu" for t in sources)
    hosts = _pinned_like(sources) if on_device else [_host_like(t, False) for t in sources]
    with torch.no_grad():
        for host, t in zip(hosts, sources, strict=True):
            host.copy_(t, non_blocking=on_device)
    if on_device:
        torch.accelerator.synchronize()  # the copies are complete before the step may run on
    staged, at = {}, 0
    for key, chunks in entries.items():
        parts = []
        for offsets, _ in chunks.parts:
            parts.append((offsets, hosts[at]))
            at += 1
        staged[key] = Chunks(chunks.size, parts)
    return staged, sum(h.numel() * h.element_size() for h in hosts)


def _host_like(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty host tensor of `t`'s shape, dtype and (dense) strides."""
    return torch.empty_like(t, device="cpu", pin_memory=pin)


def _pinned_like(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """Pinned host tensors like `sources`: the last save's where the layout is the same."""
    global _pinned
    layout = tuple((tuple(t.shape), t.stride(), t.dtype) for t in sources)
    if _pinned is None or _pinned[0] != layout:
        _pinned = None  # free the old buffers before pinning new ones
        _pinned = (layout, [_host_like(t, True) for t in sources])
    return _pinned[1]
