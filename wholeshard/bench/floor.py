"""The floor of a step: the two parts no distributed scheme can remove, measured in the bench's
worker processes on the same data as the timed steps.

- forward + backward of this rank's micro-batch on the bare model (the configuration's model,
  unwrapped: no hooks, no communication), over the same batches as the timed steps;
- one optimizer step over this rank's owned share alone: the configuration's own ownership rule
  and arithmetic (`Setup.owned_optimizers`) on fresh copies of the params it owns, with the
  bare model's gradients of the last batch, issuing no collectives.

A row's `floor_s` is the slowest rank's forward + backward plus the busiest rank's optimizer
step (`report.from_ranks`); its `ratio_vs_floor` is `step_s / floor_s`. Both ranks measure at
once, so they compete for the cores as they do in the timed steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..planning.routing import Route, route_params
from .workloads import Workload

OwnedOptimizers = Callable[[list[Route]], list[torch.optim.Optimizer]]
"""Given the bare model's routes (each param holding its gradient): optimizers over fresh copies
of the share this rank updates, with those gradients, that issue no collectives."""


def measure(
    bare_model: nn.Module,
    workload: Workload,
    owned_optimizers: OwnedOptimizers,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    warmup: int,
) -> dict[str, float]:
    """This rank's floor figures: medians in s over as many repetitions as the timed loop has
    timed steps (the first `warmup` + 1 untimed, as there)."""
    routes = route_params(bare_model, workload.use_muon)
    forward_backward = []
    for s, (x, y) in enumerate(batches):
        bare_model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        workload.loss(bare_model(x), y).backward()
        if s > warmup:
            forward_backward.append(time.perf_counter() - t0)
    for r in routes:  # every workload uses every param; zeros keep a stray one copyable
        if r.param.grad is None:
            r.param.grad = torch.zeros_like(r.param)
    optimizers = owned_optimizers(routes)
    if dist.is_initialized():
        dist.barrier()
    optimizer = []
    for s in range(len(batches)):
        t0 = time.perf_counter()
        for opt in optimizers:
            opt.step()
        if s > warmup:
            optimizer.append(time.perf_counter() - t0)
    return {
        "floor_forward_backward_s": statistics.median(forward_backward),
        "floor_optimizer_s": statistics.median(optimizer),
    }


def copy_with_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 leaf holding `param`'s values, its `.grad` a copy of `grad`."""
    out = param.detach().float().clone()
    out.grad = grad.detach().reshape(out.shape).float().clone(memory_format=torch.contiguous_format)
    return out
