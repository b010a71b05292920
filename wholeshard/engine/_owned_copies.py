"""Fully sharded on the exchange strategy: the whole copies of the matrices a rank owns.

[Note: owned copies]
An exchange buffer's matrix may span shards, and its owner steps it whole ([Note: exchange
buffers] in `planning._exchange`). Without resharding the owner finds it whole in its full
tensors; fully sharded, those are freed between steps, so a unit keeps, beside this rank's
shards, one copy of every matrix this rank owns: `param` (the param dtype) and `grad` (the grad
dtype), each the owned matrices end to end in buffer order. `StorageUnit.owned_views` returns
views of them, so the optimizer reads and writes only these. The exchange fills `grad` after
the reduction (the pieces this rank's shard holds by a local copy, the rest by the all-to-all),
writing every element, so `grad` is never zeroed; after the update it writes `param` back into
the holders' shards the same two ways, and the units then gather as fully sharded units do. The
copies take their first values from the full param when the unit keeps its shards (`take`).
`param` lives between steps. `grad` has storage only from the exchange to the owners until the
params go back to the holders (or the window is zeroed). A step may have clipped the owned
copies, so a verb that reads the owned grads again after a step (a second `step()` or
`clip_grad_norm_` before `zero_grad()`) raises, on every rank, naming `zero_grad()`
(`Exchange.check_grads`). So a rank holds between steps its shards plus its owned matrices'
params; the peak adds one unit's full tensors, or, at the exchange, the owned grads.
(An FP8 unit is always fully sharded, so it keeps them in every mode: [Note: FP8 units] in
`_fp8_storage`.)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import torch

from ..planning import Placement, placement_matrices


class OwnedCopies:
    """The copies of the matrices among `placements` that shard-group rank `rank` owns, like
    `param` and `grad` (dtype, device) ([Note: owned copies])."""

    def __init__(
        self,
        placements: Iterable[Placement],
        rank: int,
        param_like: torch.Tensor,
        grad_like: torch.Tensor,
    ) -> None:
        mine = (m for p in placements for m in placement_matrices(p) if m[2] == rank)
        self.ranges = sorted((lo, hi) for lo, hi, _ in mine)  # buffer ranges, in buffer order
        self._starts = [lo for lo, _ in self.ranges]
        self._at = [0]  # where each range starts in the copies
        for lo, hi in self.ranges:
            self._at.append(self._at[-1] + hi - lo)
        self.param = param_like.new_empty(self._at[-1])
        # Written whole by each grad exchange; its storage comes and goes (`StorageUnit`).
        self.grad = grad_like.new_empty(self._at[-1])

    def _at_range(self, lo: int, hi: int) -> int | None:
        """Where buffer elements `[lo, hi)` start in the copies, if they lie in one owned matrix."""
        i = bisect.bisect_right(self._starts, lo) - 1
        if i < 0 or hi > self.ranges[i][1]:
            return None
        return self._at[i] + lo - self.ranges[i][0]

    def param_view(self, lo: int, hi: int) -> torch.Tensor | None:
        """The param view of buffer elements `[lo, hi)` if they lie in one owned matrix."""
        at = self._at_range(lo, hi)
        return None if at is None else self.param[at : at + hi - lo]

    def views(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(param, grad) views of buffer elements `[lo, hi)` if they lie in one owned matrix
        (`grad` must have its storage: a view of freed storage cannot be made)."""
        at = self._at_range(lo, hi)
        if at is None:
            return None
        return self.param[at : at + hi - lo], self.grad[at : at + hi - lo]

    def take(self, full: torch.Tensor, start: int) -> None:
        """Copy the owned matrices' values out of `full`, a unit's full param tensor whose
        first element is buffer element `start`."""
        for (lo, hi), at in zip(self.ranges, self._at, strict=False):
            self.param[at : at + hi - lo].copy_(full[lo - start : hi - start])

    def nbytes(self) -> int:
        """Bytes of the param copy (what persists between steps)."""
        return self.param.nbytes
