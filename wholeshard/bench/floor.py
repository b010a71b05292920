"""The floor of a step: the two parts no distributed scheme can remove, measured in the bench's
worker processes on the same data as the timed steps.

- forward + backward of this rank's micro-batch on the bare model (the configuration's model,
  unwrapped: no hooks, no communication), over the same batches as the timed steps;
- one optimizer step over this rank's owned share alone: the configuration's own ownership rule
  and arithmetic (`Setup.owned_optimizers`) on fresh copies of the params it owns, with the
  bare model's gradients of the last batch, issuing no collectives.

A row's `floor_s` is the slowest rank's forward + backward plus the busiest rank's optimizer
step (`report.from_ranks`); its `ratio_vs_floor` is `step_s / floor_s`. Both ranks measure at
once (each optimizer phase after a barrier), so they compete for the cores as they do in the
timed steps.

Interleaved with the floor's optimizer steps, the same process times the common yardstick of
optimizer steps, `torch_muon_owned_s`: `torch.optim.Muon` stepping fresh copies of the Muon
matrices of the same owned share, each matrix (each matrix of a stack too) a param of its own,
issuing no collectives. `ns_flops_per_step` is the Newton–Schulz arithmetic of those matrices
(`flops.ns_flops`). Times come from the rank's `Timer` (CUDA events on a GPU).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..planning.routing import Route, route_params
from .configs import MUON_KW
from .flops import total_ns_flops
from .timing import Timer
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
    timer: Timer,
    yardstick: bool = True,
) -> dict[str, Any]:
    """This rank's floor figures and yardstick (module note): medians in s over as many
    repetitions as the timed loop has timed steps (the first `warmup` + 1 untimed, as there);
    `torch_muon_owned_s` is 0 when the share holds no Muon matrix, None without `yardstick`."""
    routes = route_params(bare_model, workload.matrix_params)
    forward_backward = []
    for s, (x, y) in enumerate(batches):
        bare_model.zero_grad(set_to_none=True)
        t0 = timer.stamp()
        workload.loss(bare_model(x), y).backward()
        seconds = timer.seconds(t0, timer.stamp())
        if s > warmup:
            forward_backward.append(seconds)
    for r in routes:  # every workload uses every param; zeros keep a stray one copyable
        if r.param.grad is None:
            r.param.grad = torch.zeros_like(r.param)
    optimizers = owned_optimizers(routes)
    matrices = muon_matrices(optimizers)
    reference_optimizers = torch_muon(matrices) if yardstick else []
    optimizer, reference = [], []
    for _ in batches:
        # Every rank runs the same phase at once, as in the timed steps (barriers untimed).
        optimizer.append(_timed_steps(optimizers, timer))
        if yardstick:
            reference.append(_timed_steps(reference_optimizers, timer))
    del optimizer[: warmup + 1], reference[: warmup + 1]
    return {
        "floor_forward_backward_s": statistics.median(forward_backward),
        "floor_optimizer_s": statistics.median(optimizer),
        "torch_muon_owned_s": (
            (statistics.median(reference) if reference_optimizers else 0.0) if yardstick else None
        ),
        "ns_flops_per_step": total_ns_flops(m.shape for m in matrices),
    }


def _timed_steps(optimizers: list[torch.optim.Optimizer], timer: Timer) -> float:
    """Seconds one step of every optimizer takes, all ranks starting together."""
    if dist.is_initialized():
        dist.barrier()
    t0 = timer.stamp()
    for opt in optimizers:
        opt.step()
    return timer.seconds(t0, timer.stamp())


def muon_matrices(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The params the share's optimizers orthogonalize: those of a `torch.optim.Muon` (or
    subclass), and of a group marked `use_muon` (`MuonWithAuxAdam`'s)."""
    out: list[torch.Tensor] = []
    for opt in optimizers:
        for group in opt.param_groups:
            if isinstance(opt, torch.optim.Muon) or group.get("use_muon"):
                out += group["params"]
    return out


def torch_muon(matrices: Sequence[torch.Tensor]) -> list[torch.optim.Optimizer]:
    """`torch.optim.Muon` on fresh copies of `matrices` (with their grads), every matrix of a
    stack (a param of more than 2 dims) a param of its own; [] when there are none."""
    copies = []
    for p in matrices:
        flat = p.reshape(-1, *p.shape[-2:])
        grads = p.grad.reshape(flat.shape)
        copies += [copy_with_grad(m, g) for m, g in zip(flat, grads, strict=True)]
    if not copies:
        return []
    return [torch.optim.Muon(copies, adjust_lr_fn="original", **MUON_KW)]


def copy_with_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 leaf holding `param`'s values, its `.grad` a copy of `grad`."""
    out = param.detach().float().clone()
    out.grad = grad.detach().reshape(out.shape).float().clone(memory_format=torch.contiguous_format)
    return out
