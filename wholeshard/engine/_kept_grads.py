"""Autograd's gradients kept until a fully sharded unit's full grads need storage.

[Note: kept gradients]
Resharding, where autograd's gradients (the param dtype) are smaller than the grad-reduce dtype
(bf16 params, fp32 reduction), a unit keeps each param's first gradient of the window as autograd
made it and gives its full grads storage only when one must be added in: at its reduction, or at
a param's second gradient in the window (`no_sync`). While the next unit's backward runs beside
this one's reduction, its gradients then cost 2 bytes an element where full grads cost 4 (FSDP2
keeps them alike). Each kept gradient is added into zeros once, in place of the add on arrival:
the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KeptGrads:
    """One storage unit's kept gradients, by param index ([Note: kept gradients])."""

    def __init__(self) -> None:
        self._grads: dict[int, torch.Tensor] = {}

    def keep(self, i: int, grad: torch.Tensor, full: torch.Tensor) -> bool:
        """Keep param i's first gradient of the window where its elements are smaller than
        those of `full` (the unit's full grads, with no storage yet); whether it was kept."""
        if grad.element_size() >= full.element_size():
            return False
        self._grads[i] = grad
        return True

    def add_into(self, views: Sequence[torch.Tensor]) -> None:
        """Add every kept gradient into its param's view of the full grads, and drop them (no
        work where none is kept: every gradient added on arrival passes here)."""
        for i, grad in self._grads.items():
            views[i].add_(grad)
        self._grads.clear()

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self._grads.values())
