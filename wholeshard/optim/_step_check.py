"""The step check: one small all-reduce that every rank takes before any update.

It carries, over the whole data-parallel group: the first param (by registration index, the
same on every rank) whose averaged gradient has an inf or nan, the lowest and highest step
count, whether some rank's model changed after wrapping, and which params got a gradient on
some rank. So every rank takes the same decision: raise (a changed model, ranks at different
steps, a non-finite gradient under `nonfinite="error"`), skip the update (`nonfinite="skip"`),
or step exactly the params that got a gradient. One `MAX` all-reduce of float64 values (four,
then one flag per param) carries it all (a minimum travels as a negated maximum).

[Note: host syncs in a step]
Reading the check's result on the host waits for the device: the one sync of a step. With
`nonfinite` set it is read at once, since a non-finite gradient decides whether the step
happens. With `nonfinite=None` nothing in it can stop this step: the result is staged to host
memory behind the all-reduce and judged (a changed model, ranks at different steps) at the
start of the next step, or when the optimizer's state is read, on every rank at the same point,
so such a mistake raises one step later. The step goes on with the params some rank got a
gradient for: all of them when this rank got every one (zero syncs), else the result is read
now for the others' flags (one sync, the judging still waits). Fully sharded with
`overlap_grad_reduce` over 2+ ranks, backward reads one more value, which modules every rank ran
in this forward ([Note: collective order] in the engine's `_schedule`): one sync more either way.

[Note: step check order]
Every rank issues the step check after it dispatched every reduction of the step. Which
reductions leave during backward differs by rank (a unit holding a module one rank skipped, an
MoE expert none of its tokens chose, completes there only at the step), so the check is the one
place in a step where the ranks meet whatever their backward did; issued before the reductions
left at the step, it would precede them on one rank and follow them on another: on one group a
mismatch, across groups an order NCCL hangs on (`TORCH_DISTRIBUTED_DEBUG=DETAIL` blocks on it
too). Where the check reads gradients it waits for the reductions anyway; where it reads none (a
pipelined step with `nonfinite=None`) the step only dispatches the rest (`start_grad_sync`, no
wait, no host sync), so the updates still overlap the reductions in flight, and the check, on a
separate all-gather group, does not queue behind them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..distributed import collectives

NonfinitePolicy = Literal["error", "skip"]
NONFINITE_POLICIES: tuple[NonfinitePolicy | None, ...] = ("error", "skip", None)
_NONE = 2.0**52  # "no non-finite param": above any param index, exact in float64


@dataclass(frozen=True)
class Verdict:
    """What every rank learns from the step check."""

    first_nonfinite: int | None  # lowest param index with a non-finite gradient on any rank
    steps: tuple[int, int]  # (lowest, highest) step count over the ranks
    changed: bool  # some rank's model changed after wrapping
    received: tuple[bool, ...]  # per param index: some rank got a gradient for it


def peak_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each gradient's largest magnitude (inf or nan exactly when it has an inf or nan)."""
    return torch.stack(torch._foreach_norm(list(grads), math.inf)).float()


def first_nonfinite(grads: Sequence[torch.Tensor]) -> int | None:
    """The index of the first of `grads` holding an inf or nan, or None (one device sync)."""
    if not grads:
        return None
    bad = (~torch.isfinite(peak_norms(grads))).nonzero()
    return int(bad[0]) if len(bad) else None


class PendingCheck:
    """A step check whose all-reduce is issued; `verdict()` reads it.

    `stage()` copies the result to host memory behind the all-reduce (pinned, without
    blocking, and an event marks its arrival on CUDA), so a `verdict()` read later (a step
    later: the copy landed long before, unless the GPU is a whole step behind the host) does
    not wait for the device; read without staging, `verdict()` waits for the device (one sync).
    """

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values
        self.host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._verdict: Verdict | None = None

    def stage(self) -> PendingCheck:
        cuda = self.values.device.type == "cuda"
        self.host = torch.empty_like(self.values, device="cpu", pin_memory=cuda)
        self.host.copy_(self.values, non_blocking=cuda)
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        return self

    def verdict(self) -> Verdict:
        if self._verdict is None:
            if self._event is not None:
                self._event.synchronize()
            values = self.values if self.host is None else self.host
            neg_first, high, neg_low, changed_any, *received_any = values.tolist()
            self._verdict = Verdict(
                first_nonfinite=None if -neg_first >= _NONE else int(-neg_first),
                steps=(int(-neg_low), int(high)),
                changed=bool(changed_any),
                received=tuple(r > 0 for r in received_any),
            )
        return self._verdict


def issue(
    step: int,
    *,
    indices: torch.Tensor,
    norms: torch.Tensor | None,
    changed: bool,
    received: Sequence[bool],
    group: ProcessGroup | None,
    world: int,
    device: torch.device,
) -> PendingCheck:
    """Issue the check's all-reduce, combining every rank's view. `norms[i]` is any norm of
    the gradient of param `indices[i]` (`indices`: float64 on `device`; a norm is non-finite
    exactly when that gradient is); None: not checked on this rank. `received[j]`: this rank
    got a gradient for param `j` (every rank passes one flag per param)."""
    head = [-_NONE, step, -step, float(changed)]
    # Built in pinned host memory and copied without blocking: no wait for backward to finish.
    host = torch.tensor(
        head + [float(r) for r in received], dtype=torch.float64, pin_memory=device.type == "cuda"
    )
    t = host.to(device, non_blocking=True)
    if norms is not None and len(indices):
        t[0] = -torch.where(torch.isfinite(norms), _NONE, indices).min()
    if world > 1:
        collectives.all_reduce(t, group, op=dist.ReduceOp.MAX)
    return PendingCheck(t)
