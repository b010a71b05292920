"""`NorMuon`: Muon followed by neuron-wise (per-row) second-moment normalisation, with the
update's norm preserved (Li et al., "NorMuon: Making Muon more efficient and scalable",
arXiv 2510.05491); the Newton-Schulz coefficient schedules it can orthogonalize with; and
`Muon`, torch's Muon with the same choice of schedule.

The maths follows the authors' single-device reference (`SingleDeviceNorMuon` in
github.com/zichongli5/NorMuon, `normuon.py`), in its order and dtypes. For one matrix G
(out, in) with momentum buffer M (like G) and second moment v (out, 1), both zero at first:

    M <- lerp(M, G, 1 - momentum)                  (M = momentum * M + (1 - momentum) * G)
    U <- lerp(G, M, momentum) if nesterov else M
    O <- NS(U)                                     bf16 Newton-Schulz (below); O is bf16
    v <- lerp(v, mean(O * O, dim=-1), 1 - beta2)   per row; no bias correction
    O' <- O / (sqrt(v) + eps)                      rounded to bf16
    O' <- O' * (|O|_F / (|O'|_F + eps))            the update keeps the norm of O
    O' <- O' * sqrt(max(1, out / in))
    W <- W * (1 - lr * weight_decay)               only when the param has a gradient
    W <- W - lr * O'

NS(U), "quintic" (the reference's, and torch's Muon coefficients): X = bf16(U), transposed
when out > in, X <- X / (|X|_F + 1e-7), then `ns_steps` times A = X Xᵀ, B = b A + c A A,
X <- a X + B X with (a, b, c) = (3.4445, -4.7750, 2.0315), every product rounded to bf16.
"polar_express" (Amsel et al., "The Polar Express", arXiv 2505.16932, Algorithm 1): the same
iteration with a new (a, b, c) per step (`POLAR_EXPRESS`, each divided by the safety factor
1.01, 1.01³, 1.01⁵ except the last, which repeats past the eighth step) after
X <- X / (1.01 |X|_F + 1e-7).

Where this departs from the reference, and why:
- the reference lerps its second moment (the param's dtype) towards the bf16 row means,
  which torch rejects for fp32 params ("expected dtype float for `end`"); here the bf16 row
  means are cast to the second moment's dtype first (a no-op for bf16 params, whose steps
  are then the reference's bit for bit);
- the reference overwrites `p.grad` with the Nesterov blend; here the blend is a new tensor
  and `p.grad` is left alone (the same values either way).
As in the reference, a param whose `.grad` is None gets `p.grad = zeros` and is stepped on
that zero gradient (momentum decays, the update is applied) without weight decay. (Through
`LayerwiseOptimizer` that never happens: a param no rank got a gradient for is not stepped.)

A `MatrixRule`: `LayerwiseOptimizer(ddp, matrix=dict(...), matrix_optimizer=NorMuon)` runs it
distributed unchanged. Its state per param, `momentum_buffer` (shaped like the param) and
`second_momentum_buffer` (the param's shape with the last dim 1), has the reference's keys:
state dicts load into the reference's optimizer and back. wholeshard checkpoints save the
second moment whole with its matrix (one value per row, not per element).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim._muon import _adjust_lr
from torch.optim.optimizer import ParamsT, _to_scalar

from ..planning.specs import newton_schulz_cost
from .gram_ns import Coefficients, NsAlgorithm, check_ns_algorithm, gram_newton_schulz
from .matrix_rule import Group, MatrixRule, MuonRule
from .tensor_parallel import (
    TpMode,
    TpShard,
    check_tp_mode,
    distributed_newton_schulz,
    gather_full,
    own_slice,
    tp_shard,
)

Schedule = str | Coefficients | Sequence[Coefficients]

QUINTIC: Coefficients = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's fixed quintic: the reference's and `torch.optim.Muon`'s default."""

POLAR_EXPRESS_RAW: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
"""The Polar Express degree-5 polynomials p(x) = a x + b x³ + c x⁵ as the paper states them
(Algorithm 1, lower bound l = 1e-3): optimal for the sign function on [l, 1], composed."""

POLAR_EXPRESS_SAFETY = 1.01
POLAR_EXPRESS: tuple[Coefficients, ...] = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in POLAR_EXPRESS_RAW[:-1]
) + (POLAR_EXPRESS_RAW[-1],)
"""What Algorithm 1 iterates: every polynomial but the last evaluated at x / 1.01 (a margin
for bf16 rounding), the last repeated for any further step."""

SCHEDULES = ("quintic", "polar_express")


def ns_schedule(ns_coefficients: Schedule, steps: int) -> tuple[list[Coefficients], float]:
    """The (a, b, c) of each of `steps` iterations, and the factor on the Frobenius norm that
    the input is divided by: "quintic" (or one (a, b, c)): the same every step, 1.0;
    "polar_express": `POLAR_EXPRESS`, its last repeated, 1.01; a sequence of triples: those,
    the last repeated, 1.0."""
    if steps < 1 or steps >= 100:
        raise ValueError(f"ns_steps must be in [1, 100), got {steps}")
    if isinstance(ns_coefficients, str):
        if ns_coefficients == "quintic":
            return [QUINTIC] * steps, 1.0
        if ns_coefficients == "polar_express":
            return _repeat_last(POLAR_EXPRESS, steps), POLAR_EXPRESS_SAFETY
    triples = [] if isinstance(ns_coefficients, str) else list(ns_coefficients)
    if len(triples) == 3 and all(isinstance(x, (int, float)) for x in triples):
        triples = [tuple(triples)]  # type: ignore[list-item]
    if not triples or any(len(t) != 3 for t in triples):
        raise ValueError(f"ns_coefficients must be one of {SCHEDULES} or (a, b, c) triples")
    return _repeat_last([tuple(map(float, t)) for t in triples], steps), 1.0  # type: ignore[misc]


def _repeat_last(triples: Sequence[Coefficients], steps: int) -> list[Coefficients]:
    return list(triples[:steps]) + [triples[-1]] * max(0, steps - len(triples))


def orthogonalize(
    g: Tensor,
    ns_coefficients: Schedule = "quintic",
    steps: int = 5,
    ns_algorithm: NsAlgorithm = "standard",
) -> Tensor:
    """The bf16 Newton-Schulz approximation of the polar factor of `g` (..., m, n), per matrix;
    see the module docstring ("gram": the same iterations by `gram_ns.gram_newton_schulz`).
    Returns bf16, shaped like `g`."""
    if g.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix, got shape {tuple(g.shape)}")
    schedule, safety = ns_schedule(ns_coefficients, steps)
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * safety + 1e-7)  # * 1.0 is exact in bf16
    if check_ns_algorithm(ns_algorithm) == "gram":
        x = gram_newton_schulz(x, schedule)
    else:
        for a, b, c in schedule:
            gram = x @ x.mT
            poly = b * gram + c * gram @ gram
            x = a * x + poly @ x
    return x.mT if tall else x


def normuon_update(
    grad: Tensor,
    momentum_buffer: Tensor,
    second_momentum: Tensor,
    settings: Mapping[str, Any],
    ns_algorithm: NsAlgorithm = "standard",
) -> Tensor:
    """One NorMuon update direction (bf16, shaped like `grad`), advancing both buffers in
    place; `grad` is not written. `settings`: a `NorMuon` param group (its `momentum`, `beta2`,
    `nesterov`, `ns_coefficients`, `ns_steps` and `eps`). 4-D grads (conv filters) are
    orthogonalized as (out, in * kh * kw), as in the reference."""
    momentum = settings["momentum"]
    momentum_buffer.lerp_(grad, 1 - momentum)
    update = grad.lerp(momentum_buffer, momentum) if settings["nesterov"] else momentum_buffer
    matrices = update.reshape(update.size(0), -1) if update.ndim == 4 else update
    schedule, steps = settings["ns_coefficients"], settings["ns_steps"]
    update = orthogonalize(matrices, schedule, steps, ns_algorithm).reshape(grad.shape)
    norm = update.norm(dim=(-2, -1), keepdim=True)
    row_mean_sq = torch.mean(update * update, dim=-1, keepdim=True)
    second_momentum.lerp_(row_mean_sq.to(second_momentum.dtype), 1 - settings["beta2"])
    update.mul_(1 / second_momentum.sqrt().add_(settings["eps"]))
    update.mul_(norm / update.norm(dim=(-2, -1), keepdim=True).add_(settings["eps"]))
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    return update


class NorMuon(MatrixRule):
    """NorMuon on each param of its groups, independently; see the module docstring.

    Args (defaults: the reference's):
        lr: learning rate (0.02).
        weight_decay: decoupled, W *= 1 - lr * weight_decay before the update (0).
        momentum: Muon's momentum (0.95).
        beta2: the per-row second moment's decay (0.95).
        nesterov: Nesterov momentum (True; the reference's `normuon_update` default).
        ns_coefficients: "quintic" (the reference's), "polar_express", or (a, b, c) triples.
        ns_steps: Newton-Schulz iterations (5).
        eps: added to sqrt(second moment) and to the normalised update's norm (1e-10).
        ns_algorithm: "standard" (the reference's iteration) or "gram" (`gram_ns`: the same
            iterations in fewer flops, not bit for bit); an attribute, not a group setting.
    """

    matrix_cost = staticmethod(newton_schulz_cost)  # the planner's default cost
    stacks = True  # a conv filter as (out, in * kh * kw), a stack per matrix
    steps_gradless = True  # the reference's: on a zero grad, without weight decay

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        beta2: float = 0.95,
        *,
        nesterov: bool = True,
        ns_coefficients: Schedule = "quintic",
        ns_steps: int = 5,
        eps: float = 1e-10,
        ns_algorithm: NsAlgorithm = "standard",
    ) -> None:
        self.ns_algorithm = check_ns_algorithm(ns_algorithm)
        if not 0.0 <= float(lr):
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0 or not 0.0 <= beta2 < 1.0:
            raise ValueError(f"momentum and beta2 must be in [0, 1), got {momentum}, {beta2}")
        if weight_decay < 0.0 or eps < 0.0:
            raise ValueError(f"weight_decay and eps must be >= 0, got {weight_decay}, {eps}")
        ns_schedule(ns_coefficients, ns_steps)  # validates
        super().__init__(
            params,
            dict(
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                beta2=beta2,
                nesterov=nesterov,
                ns_coefficients=ns_coefficients,
                ns_steps=ns_steps,
                eps=eps,
            ),
        )

    def _step_group(
        self, group: Group, params: list[Tensor], grads: list[Tensor | None], kept: list[dict]
    ) -> None:
        lr = group["lr"]
        lr = lr.item() if torch.is_tensor(lr) else lr
        for p, grad, state in zip(params, grads, kept, strict=True):
            if grad is None:  # the reference's: stepped on zeros, without weight decay
                p.grad = torch.zeros_like(p)
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
                state["second_momentum_buffer"] = torch.zeros_like(p[..., 0:1])
            momentum, second = state["momentum_buffer"], state["second_momentum_buffer"]
            update = normuon_update(p.grad, momentum, second, group, self.ns_algorithm)
            if group["weight_decay"] and grad is not None:
                p.mul_(1 - lr * group["weight_decay"])
            p.add_(update.reshape(p.shape), alpha=-lr)


class Muon(MuonRule):
    """`torch.optim.Muon` whose `ns_coefficients` may also name a schedule: "quintic" (torch's
    default (a, b, c): the same steps as torch's Muon, bit for bit), "polar_express", or a
    sequence of (a, b, c) triples (one per iteration, the last repeated). An (a, b, c) tuple is
    torch's. Same state (`momentum_buffer`) and other arguments as torch's Muon; a param without
    a grad is skipped, as there.

    The iteration is torch's `_zeropower_via_newtonschulz` (bf16, `addmm`s, the input divided by
    its Frobenius norm clamped at `eps`) with the schedule's coefficients per step; for Polar
    Express the norm is first multiplied by 1.01, as in Algorithm 1 of the paper.
    `ns_algorithm="gram"` runs the same iterations in fewer flops (`gram_ns`; not bit for bit),
    kept as an attribute so that state dicts stay torch's. A DTensor param sharded by tensor
    parallelism is orthogonalized as its logical matrix, by `tp_mode` "duplicated" or
    "distributed" ([Note: tensor-parallel Muon] in `wholeshard.optim.tensor_parallel`).
    """

    matrix_cost = staticmethod(newton_schulz_cost)  # the planner's default cost

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Schedule = "quintic",
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_algorithm: NsAlgorithm = "standard",
        tp_mode: TpMode = "duplicated",
    ) -> None:
        ns_schedule(ns_coefficients, ns_steps)  # validates
        self.tp_mode = check_tp_mode(tp_mode)
        super().__init__(
            params,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_algorithm=ns_algorithm,
        )

    def _step_group(
        self, group: Group, params: list[Tensor], grads: list[Tensor], kept: list[Tensor]
    ) -> None:
        lr = _to_scalar(group["lr"])
        schedule, safety = ns_schedule(group["ns_coefficients"], group["ns_steps"])
        for p, grad, buf in zip(params, grads, kept, strict=True):
            buf.lerp_(grad, 1 - group["momentum"])
            update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            shard = tp_shard(update)
            if shard is None:
                update = _torch_form_ns(update, schedule, safety, group["eps"], self.ns_algorithm)
            else:  # [Note: tensor-parallel Muon]
                update = self._tp_ns(update, shard, schedule, safety, group["eps"])
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))

    def _tp_ns(
        self,
        update: Tensor,
        shard: TpShard,
        schedule: list[Coefficients],
        safety: float,
        eps: float,
    ) -> Tensor:
        """Newton–Schulz of the logical matrix a DTensor `update` is a slice of, as a DTensor
        laid out like it ([Note: tensor-parallel Muon])."""
        from torch.distributed.tensor import DTensor

        local, shape = update.to_local(), tuple(update.shape)
        if self.tp_mode == "distributed":
            local = distributed_newton_schulz(local, shard, shape, schedule, safety, eps)
        else:
            full = gather_full(local.bfloat16(), shard)
            full = _torch_form_ns(full, schedule, safety, eps, self.ns_algorithm)
            local = own_slice(full, shard)
        return DTensor.from_local(
            local, update.device_mesh, update.placements, shape=update.shape, stride=update.stride()
        )


def _torch_form_ns(
    grad: Tensor,
    schedule: list[Coefficients],
    safety: float,
    eps: float,
    ns_algorithm: NsAlgorithm = "standard",
) -> Tensor:
    """torch's `_zeropower_via_newtonschulz` with coefficients per iteration (2-D `grad`); with
    "gram", its iterations by `gram_newton_schulz`."""
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    norm = x.norm()
    x.div_((norm if safety == 1.0 else norm * safety).clamp(min=eps))
    if ns_algorithm == "gram":
        x = gram_newton_schulz(x, schedule)
    else:
        for a, b, c in schedule:
            gram = x @ x.T
            gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x
