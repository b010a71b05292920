"""Fully sharded on the exchange strategy: the whole copies of the matrices a rank owns.

[Note: owned copies]
An exchange buffer's matrix may span shards, and its owner steps it whole ([Note: exchange
buffers] in `planning._exchange`). Without resharding the owner finds it whole in its full
tensors; fully sharded, those are freed between steps, so a unit has, beside this rank's
shards, one copy of every matrix this rank owns: `param` (the param dtype) and `grad` (the grad
dtype), each the owned matrices end to end in buffer order. `StorageUnit.owned_views` returns
views of them, so the optimizer reads and writes only these. The exchange fills `grad` after
the reduction (the pieces this rank's shard holds by a local copy, the rest by the all-to-all),
writing every element, so `grad` is never zeroed; after the update it writes `param` back into
the holders' shards the same two ways, and the units then gather as fully sharded units do. The
copies take their first values from the full param when the unit keeps its shards (`take`).

`grad` has storage only from the exchange to the owners until the params go back to the
holders, or the window is zeroed (`free`); a view of it gives it storage back (`hold`). A step
may have clipped the owned copies, so a verb that reads the owned grads again after a step (a
second `step()` or `clip_grad_norm_` before `zero_grad()`) raises, on every rank, naming
`zero_grad()` (`Exchange.check_grads`). `param` lives the same way (`transient`) once the
optimizer says it keeps a master of its own for every piece it owns of the unit
(`StepProtocol.masters_kept`, `drop_params`: bf16 params with fp32 masters). The invariant that
makes its values needless between steps: every owned param equals its master cast to the param
dtype, and whatever gives `param` storage writes all of it from the masters before anything
reads it: each update writes the param of every owned piece, stepped or not
(`optim.pieces.params_from_masters`), before the params go back; a load writes them all after
`StepProtocol.hold_owned_params` (`install_state`); a reader between steps takes the master's
cast (`OwnedPiece.value`: checkpoints). Those masters die with their optimizer, so before the
next optimizer reads the params (`StepProtocol.owned`), or once this one is gone, the copies
live between steps again, written from its masters (`keep_params_again`). With fp32 params the
copy is the master itself and `param` lives between steps. So a rank holds between steps its
shards (plus, without separate masters, its owned matrices' params); the peak adds one unit's
full tensors, or, at the exchange, the owned copies. (An FP8 unit quantizes from `param` at its
gather, so it keeps it (`keep_params`); it is always fully sharded, so it keeps it in every
mode: [Note: FP8 units] in `_fp8_storage`.)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import torch

from ..planning import Placement, placement_matrices
from . import _resize


class OwnedCopies:
    """The copies of the matrices among `placements` that shard-group rank `rank` owns, like
    `param` and `grad` (dtype, device) ([Note: owned copies])."""

    transient: bool  # `param`, too, has storage only through a step (`drop_params`)
    keep_params: bool  # `param` lives between steps whatever the optimizer keeps (FP8 units)

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
        self.grad = grad_like.new_empty(self._at[-1])  # written whole by each grad exchange
        self.transient = self.keep_params = False
        self.free()

    def drop_params(self) -> None:
        """From now on `param` has storage only through a step, like `grad`: the optimizer
        writes every owned param from a master of its own ([Note: owned copies])."""
        if not self.keep_params:
            self.transient = True
            _resize.free(self.param)

    def keep_params_again(self) -> None:
        """`param` lives between steps again (the optimizer that dropped it is going); its
        values are whatever is written next."""
        self.hold(grad=False)
        self.transient = False

    def hold(self, grad: bool = True) -> None:
        """Give the copies that live only through a step their storage back (`grad`; `param`
        once transient): a view needs it. Their values are whatever is written next."""
        for t in (self.grad,) * grad + (self.param,) * self.transient:
            if not _resize.allocated(t):
                _resize.alloc(t)

    def free(self) -> None:
        """Free the storage of the copies that live only through a step."""
        _resize.free(self.grad)
        if self.transient:
            _resize.free(self.param)

    def _at_range(self, lo: int, hi: int) -> int | None:
        """Where buffer elements `[lo, hi)` start in the copies, if they lie in one owned matrix."""
        i = bisect.bisect_right(self._starts, lo) - 1
        if i < 0 or hi > self.ranges[i][1]:
            return None
        return self._at[i] + lo - self.ranges[i][0]

    def param_view(self, lo: int, hi: int) -> torch.Tensor | None:
        """The param view of buffer elements `[lo, hi)` if they lie in one owned matrix."""
        at = self._at_range(lo, hi)
        if at is None:
            return None
        self.hold(grad=False)
        return self.param[at : at + hi - lo]

    def views(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(param, grad) views of buffer elements `[lo, hi)` if they lie in one owned matrix."""
        at = self._at_range(lo, hi)
        if at is None:
            return None
        self.hold()
        return self.param[at : at + hi - lo], self.grad[at : at + hi - lo]

    def take(self, full: torch.Tensor, start: int) -> None:
        """Copy the owned matrices' values out of `full`, a unit's full param tensor whose
        first element is buffer element `start`."""
        self.hold(grad=False)
        for (lo, hi), at in zip(self.ranges, self._at, strict=False):
            self.param[at : at + hi - lo].copy_(full[lo - start : hi - start])

    def nbytes(self) -> int:
        """Bytes of the param copy kept between steps (0 once transient)."""
        return 0 if self.transient else self.param.nbytes
