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
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..distributed import collectives

if TYPE_CHECKING:
    from ..engine.data_parallel import DataParallel

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


class StepCheck:
    """One optimizer's step checks on `ddp`: `take` issues this step's and returns the params
    to step; with `nonfinite=None` the check is judged at the next `take` or `judge_unread`,
    on every rank at the same point ([Note: host syncs in a step]). `owned`: the names of the
    params whose gradients the optimizer passes norms of, in that order."""

    def __init__(
        self, ddp: DataParallel, owned: Sequence[str], nonfinite: NonfinitePolicy | None
    ) -> None:
        self.ddp, self.nonfinite = ddp, self.policy(nonfinite)
        index = {r.name: i for i, r in enumerate(ddp.routes)}
        self._indices = torch.tensor(
            [index[name] for name in owned], dtype=torch.float64, device=ddp.device
        )
        self._unread: tuple[int, str | None, PendingCheck] | None = None  # a check read late

    @staticmethod
    def policy(nonfinite: object) -> NonfinitePolicy | None:
        """`nonfinite` if it is a policy; else the error that lists them."""
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be 'error', 'skip' or None, got {nonfinite!r}")
        return nonfinite  # type: ignore[return-value]

    def take(self, step: int, norms: torch.Tensor | None) -> frozenset[str] | None:
        """Take step `step`'s check with every rank: raise on a changed model, ranks at
        different steps, or (policy "error") a non-finite gradient. Return the names of the
        params to step (those that got a gradient on some rank), or None when every rank skips
        this step (policy "skip"). `norms`: any norm of each owned gradient (None: unchecked)."""
        self.judge_unread()
        ddp, protocol = self.ddp, self.ddp.step_protocol
        change = protocol.model_changes()
        received, experts = protocol.received_grads(), ddp.expert_layout
        pending = issue(
            step,
            indices=self._indices,
            norms=None if self.nonfinite is None else norms,
            changed=change is not None,
            received=experts.spread(received) if experts else received,
            group=self._group(reads_grads=self.nonfinite is not None),
            world=ddp.model_ranks.size,  # dp (x tp: the group above)
            device=ddp.device,
        )
        if self.nonfinite is not None:
            return self._judge(step, change, pending.verdict())
        # Judged at the next step on every rank alike; read now only for what others received.
        self._unread = (step, change, pending.stage())
        got = self._agreed(pending.verdict().received) if not all(received) else received
        return frozenset(r.name for r, g in zip(ddp.routes, got, strict=True) if g)

    def judge_unread(self) -> None:
        """Read a step check left unread and raise what it found (on every rank alike)."""
        if self._unread is not None:
            (step, change, pending), self._unread = self._unread, None
            self._judge(step, change, pending.verdict())

    def forget_unread(self) -> None:
        """Drop a check left unread: the state it judged is replaced (a load)."""
        self._unread = None

    def _agreed(self, flags: Sequence[bool]) -> Sequence[bool]:
        """Per route, from the step check: whether some rank holding it got a gradient."""
        return self.ddp.expert_layout.pick(flags) if self.ddp.expert_layout else flags

    def _judge(self, step: int, change: str | None, verdict: Verdict) -> frozenset[str] | None:
        ddp = self.ddp
        if verdict.changed:
            raise RuntimeError(change or "another rank's model changed after it was wrapped")
        low, high = verdict.steps
        if low != high:
            raise RuntimeError(
                f"ranks disagree on the step: this rank is at optimizer step {step}, the ranks "
                f"range from {low} to {high}. Every rank must call optimizer.step() the same "
                f"number of times and load the same checkpoint"
            )
        if verdict.first_nonfinite is None:
            received = zip(ddp.routes, self._agreed(verdict.received), strict=True)
            return frozenset(r.name for r, got in received if got)
        if self.nonfinite == "skip":
            return None
        raise FloatingPointError(
            f"non-finite gradient at optimizer step {step}: "
            f"{ddp.routes[verdict.first_nonfinite].name!r} is the first param (in registration "
            f"order) whose averaged gradient has an inf or nan. Nothing was updated; pass "
            f"nonfinite='skip' to LayerwiseOptimizer to skip such steps instead"
        )

    def _group(self, reads_grads: bool) -> ProcessGroup | None:
        """Where the check runs: the data-parallel group; when it reads no gradient and a
        separate all-gather group spans every rank, that group, where the check does not wait
        behind the reductions in flight (a pipelined step keeps overlapping them). Tensor
        parallel: dp x tp, so tp peers skip alike (one stepping alone would hang the other)."""
        ddp = self.ddp
        if ddp.tensor_parallel:
            return ddp.model_ranks.group
        spans = ddp.shard_group_size == ddp.dp_size and ddp.gather_group is not ddp.shard_group
        return ddp.gather_group if spans and not reads_grads else ddp.process_group
