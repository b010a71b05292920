"""`MatrixRule`: the skeleton every matrix rule shares, so that each keeps only its own maths
(`_step_group`): `NorMuon` and `SOAP`, and through `MuonRule` (the skeleton over
`torch.optim.Muon`) `Muon` and `BatchedMuon`; `closure_loss`, the closure part of any torch
optimizer's step.

Invariants:
- every param of every group is a matrix (2-D; more with `stacks`), checked at construction;
- a step runs the closure (if any) with grad enabled, then each group in order: its params to
  step (`_gather`: those with a grad, in group order, each once; every one with
  `steps_gradless`, a missing grad as None), their grads and what the rule keeps for each (the
  live `self.state[p]`; for a `MuonRule`, the `momentum_buffer` torch's `_init_group` makes)
  go to `_step_group`, which reads nothing else; a group with none to step is not handed over;
- a sparse grad raises before any param of its group is touched.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from .gram_ns import NsAlgorithm, check_ns_algorithm

Group = MutableMapping[str, Any]


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """What `closure` returns, run with grad enabled (None without a closure)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class MatrixRule(torch.optim.Optimizer):
    """A torch optimizer that steps each param of its groups from that param, its grad and its
    own state alone; subclasses write `_step_group`. See the module docstring."""

    stacks: ClassVar[bool] = False
    """Whether a param may be a stack of matrices (more than 2-D); else each is one matrix."""
    steps_gradless: ClassVar[bool] = False
    """Whether a param without a grad is stepped too (handed over with grad None)."""

    def __init__(self, params: ParamsT, *args: Any, **kwargs: Any) -> None:
        """The next class's constructor (torch's `Optimizer`: `params` and the groups'
        defaults), then a ValueError naming the first param that is not a matrix."""
        super().__init__(params, *args, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2 or (p.ndim > 2 and not self.stacks):
                    sides = "2-D or more" if self.stacks else "2-D"
                    raise ValueError(
                        f"{type(self).__name__} steps matrices ({sides}), got a param of shape "
                        f"{tuple(p.shape)}: give vectors and scalars to another optimizer"
                        + ("" if self.stacks else ", one matrix of a stack per param")
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            params, grads, kept = self._gather(group)
            if params:
                self._step_group(group, params, grads, kept)
        return loss

    def _gather(self, group: Group) -> tuple[list[Tensor], list[Any], list[Any]]:
        """The params of `group` to step, their grads and their state dicts."""
        params = [p for p in group["params"] if p.grad is not None or self.steps_gradless]
        grads = [p.grad for p in params]
        if any(g is not None and g.is_sparse for g in grads):
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        return params, grads, [self.state[p] for p in params]

    def _step_group(
        self, group: Group, params: list[Tensor], grads: list[Any], kept: list[Any]
    ) -> None:
        """The rule's update of `params` (non-empty) from `grads` and `kept` (`_gather`)."""
        raise NotImplementedError


class MuonRule(MatrixRule, torch.optim.Muon):
    """`MatrixRule` over `torch.optim.Muon`: torch's constructor (its arguments, defaults and
    checks; plus keyword-only `ns_algorithm`, an attribute), param groups and state; a group is
    gathered by torch's `_init_group` (params with a grad; their momentum buffers as `kept`)."""

    def __init__(
        self, params: ParamsT, *args: Any, ns_algorithm: NsAlgorithm = "standard", **kwargs: Any
    ) -> None:
        self.ns_algorithm = check_ns_algorithm(ns_algorithm)
        super().__init__(params, *args, **kwargs)

    def _gather(self, group: Group) -> tuple[list[Tensor], list[Any], list[Any]]:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        bufs: list[Tensor] = []
        self._init_group(group, params, grads, bufs)  # torch's: skips None grads, makes state
        return params, grads, bufs
