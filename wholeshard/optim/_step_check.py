"""The step check: one small all-reduce that every rank takes before any update.

It carries, over the whole data-parallel group: the first param (by registration index, the
same on every rank) whose averaged gradient has an inf or nan, the lowest and highest step
count, whether some rank's model changed after wrapping, and which params got a gradient on
some rank. So every rank takes the same decision: raise (a changed model, ranks at different
steps, a non-finite gradient under `nonfinite="error"`), skip the update (`nonfinite="skip"`),
or step exactly the params that got a gradient. One `MAX` all-reduce of float64 values (four,
then one flag per param) carries it all (a minimum travels as a negated maximum); it is built
in pinned memory and copied without blocking, and its result is read on the host: one device
sync per step.
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


def agree(
    step: int,
    *,
    indices: torch.Tensor,
    norms: torch.Tensor | None,
    changed: bool,
    received: Sequence[bool],
    group: ProcessGroup | None,
    world: int,
    device: torch.device,
) -> Verdict:
    """Combine every rank's view. `norms[i]` is any norm of the gradient of param `indices[i]`
    (`indices`: float64 on `device`; a norm is non-finite exactly when that gradient is); None:
    not checked on this rank. `received[j]`: this rank got a gradient for param `j` (every
    rank passes one flag per param)."""
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
    neg_first, high, neg_low, changed_any, *received_any = t.tolist()
    return Verdict(
        first_nonfinite=None if -neg_first >= _NONE else int(-neg_first),
        steps=(int(-neg_low), int(high)),
        changed=bool(changed_any),
        received=tuple(r > 0 for r in received_any),
    )
