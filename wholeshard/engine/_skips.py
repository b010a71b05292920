"""Which storage units every rank ran all the modules of in this forward ([Note: collective
order] in `_schedule`): fully sharded with overlapped reductions, a unit holding a module that
one rank skipped (an MoE expert no token chose) completes at another point on each rank, so the
ranks agree on those units before backward reduces any of them."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup, Work

from ..distributed import collectives


class RanEverywhere:
    """Per unit, whether every rank ran all the modules holding its params in the last forward:
    `exchange` starts the all-reduce (MIN) at the end of a forward, staged through a pinned host
    buffer so that nothing there waits for the device; the first lookup waits for it and reads
    it (one host read); after `clear`, every unit counts as run."""

    def __init__(self, units: int, device: torch.device, group: ProcessGroup | None) -> None:
        self.group = group
        self.host = torch.zeros(units, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.values = self.host if device.type == "cpu" else self.host.to(device)
        self._work: Work | None = None
        self._pending = False  # an exchange in flight, not read yet
        self._read: list[int] | None = None

    def clear(self) -> None:
        """Forget the last agreement (one never read lands first: its buffer is reused)."""
        if self._pending:
            collectives.wait(self._work)
        self._read, self._pending = None, False

    def exchange(self, forward_left: list[int]) -> None:
        """Start agreeing on `forward_left` (per unit, its modules yet to finish forward)."""
        self.clear()
        self.host.copy_(torch.tensor([int(left <= 0) for left in forward_left]))
        if self.values is not self.host:
            self.values.copy_(self.host, non_blocking=True)
        self._work = collectives.all_reduce_min(self.values, self.group)
        self._pending = True

    @property
    def pending(self) -> bool:
        """Whether an exchange is in flight, not read yet (the next lookup waits for it)."""
        return self._pending

    def read_agreement(self) -> None:
        """Wait for the exchange in flight, if any, and read it."""
        if self._pending:
            collectives.wait(self._work)
            self._read, self._pending = self.values.tolist(), False

    def __getitem__(self, unit: int) -> bool:
        self.read_agreement()
        return self._read is None or bool(self._read[unit])
