"""`SOAP`: Shampoo-preconditioned Adam (Vyas et al., "SOAP: Improving and Stabilizing Shampoo
using Adam", arXiv 2409.11321): Adam run in the eigenbasis of Shampoo's Kronecker factors.

The maths follows the authors' reference (`SOAP` in github.com/nikhilvyas/SOAP, `soap.py`), its
defaults and its order of operations, for matrices. For one matrix W (m, n) with gradient G,
Kronecker factors L (m, m) and R (n, n), their eigenbases Q_L and Q_R, and Adam moments M and V
(like G, held in the rotated basis); a side longer than `max_precond_dim` has no factor (its
rotation is the identity):

    first step (state empty): L = (1 - sb) G Gᵀ, R = (1 - sb) Gᵀ G; Q = eigh's eigenvectors,
        in order of descending eigenvalue; M = V = 0; W is not changed (no update, no decay)
    every later step, t = 1, 2, ...:
    G' = Q_Lᵀ G Q_R                                  the gradient in the eigenbasis
    M <- b1 M + (1 - b1) G';  V <- b2 V + (1 - b2) G'²
    U = Q_L (M / (sqrt(V) + eps)) Q_Rᵀ               back in the param's basis
    U <- U / (1e-30 + rms(U))                        only with `normalize_grads`
    W <- W - lr * sqrt(1 - b2^t) / (1 - b1^t) * U   (the bias correction is in the step size;
                                                     without `correct_bias`, lr alone)
    W <- W - lr * weight_decay * W                   after the update, as the reference does
    M <- Q_L M Q_Rᵀ                                  the first moment leaves the eigenbasis,
    L <- lerp(L, G Gᵀ, 1 - sb);  R <- lerp(R, Gᵀ G, 1 - sb)
    if t % precondition_frequency == 0: refresh Q_L, Q_R (below), permuting V with them
    M <- Q_Lᵀ M Q_R                                  and comes back in (the new basis)

where sb = shampoo_beta, or b2 when shampoo_beta < 0. The refresh of one side, factor F and basis
Q: e = diag(Qᵀ F Q), the order s sorting e descending, V's rows (or columns, for R) taken in the
order s, Q <- qr(F Q[:, s]).Q: one power iteration and a QR step.

Where this departs from the reference, and why:
- the state is plain tensors, one per key (`step`, `exp_avg`, `exp_avg_sq`, `GG0`, `GG1`, `Q0`,
  `Q1`; a factor and basis key is absent for a side longer than `max_precond_dim`) where the
  reference keeps lists `GG` and `Q` and an int `step`: wholeshard checkpoints hold tensor state
  only, so every value is a tensor; `step` is an int64 tensor on the CPU;
- `precondition_frequency` and `shampoo_beta` are read from the param group at each step (the
  reference copies them into the state at the first step);
- V is permuted in place (the reference replaces the tensor: the same values);
- only matrices: a param of another number of dims raises, and `merge_dims` and
  `precondition_1d` (which only change such params, or merge a matrix's two dims into one) must
  be False, their defaults.

A `MatrixRule`: `LayerwiseOptimizer(ddp, matrix=dict(...), matrix_optimizer=SOAP)` runs it
distributed unchanged, its construction laying the params out so that the planner balances
SOAP's work (`matrix_cost`) rather than Newton-Schulz's. A checkpoint reshards `exp_avg` and
`exp_avg_sq` with the param and saves `step`, `GG*` and `Q*` whole with their matrix.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from .matrix_rule import Group, MatrixRule

MAX_PRECOND_DIM = 10000
"""The reference's default: a side longer than this has no factor (its rotation is identity)."""
PRECONDITION_FREQUENCY = 10
"""The reference's default: steps between two refreshes of the eigenbases."""
REFRESH_FLOPS = 9
"""Flops of one refresh per cube of a side d: Qᵀ F Q (4 d³), F Q (2 d³), a d x d QR (~8/3 d³)."""


class SOAP(MatrixRule):
    """SOAP on each matrix of its groups, independently; see the module docstring.

    Args (defaults: the reference's):
        lr: learning rate (3e-3).
        betas: Adam's (b1, b2) in the eigenbasis ((0.95, 0.95)).
        shampoo_beta: decay of the Kronecker factors; < 0 takes b2 (-1).
        eps: added to sqrt(V) (1e-8).
        weight_decay: decoupled, W -= lr * weight_decay * W after the update (0.01).
        precondition_frequency: steps between refreshes of the eigenbases (10).
        max_precond_dim: a side longer than this is not preconditioned (10000).
        merge_dims, precondition_1d: must be False (matrices only).
        normalize_grads: divide the update by its RMS (False).
        correct_bias: Adam's bias correction, in the step size (True).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float = -1.0,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = PRECONDITION_FREQUENCY,
        max_precond_dim: int = MAX_PRECOND_DIM,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        normalize_grads: bool = False,
        correct_bias: bool = True,
    ) -> None:
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise ValueError(
                f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}"
            )
        if not all(0.0 <= b < 1.0 for b in betas) or not shampoo_beta < 1.0:
            raise ValueError(
                f"betas must be in [0, 1) and shampoo_beta < 1, got {betas}, {shampoo_beta}"
            )
        if not (isinstance(precondition_frequency, int) and precondition_frequency >= 1):
            raise ValueError(
                f"precondition_frequency must be an int >= 1, got {precondition_frequency!r}"
            )
        if merge_dims or precondition_1d:
            raise ValueError(
                "SOAP here steps matrices only: merge_dims and precondition_1d must be False"
            )
        super().__init__(
            params,
            dict(
                lr=lr,
                betas=tuple(betas),
                shampoo_beta=shampoo_beta,
                eps=eps,
                weight_decay=weight_decay,
                precondition_frequency=precondition_frequency,
                max_precond_dim=max_precond_dim,
                merge_dims=merge_dims,
                precondition_1d=precondition_1d,
                normalize_grads=normalize_grads,
                correct_bias=correct_bias,
            ),
        )

    @staticmethod
    def matrix_cost(rows: int, cols: int) -> int:
        """Flops of one step on a (rows, cols) matrix with the default settings, the planner's
        cost (`DataParallelConfig.matrix_cost`): per preconditioned side of length d, a rotation
        costs 2 rows cols d; a step makes five (G in, U out, M out and back in, the two factors'
        products) and a refresh every `PRECONDITION_FREQUENCY` steps ~`REFRESH_FLOPS` d³."""
        sides = [d for d in (rows, cols) if d <= MAX_PRECOND_DIM]
        rotations = 5 * 2 * rows * cols * sum(sides)
        return rotations + sum(REFRESH_FLOPS * d**3 for d in sides) // PRECONDITION_FREQUENCY

    def _step_group(
        self, group: Group, params: list[Tensor], grads: list[Tensor], kept: list[dict]
    ) -> None:
        beta1, beta2 = group["betas"]
        shampoo = group["shampoo_beta"] if group["shampoo_beta"] >= 0 else beta2
        for p, grad, state in zip(params, grads, kept, strict=True):
            if not state:  # the first step only sets up the preconditioner, as the reference's
                state["step"] = torch.tensor(0, dtype=torch.int64)
                state["exp_avg"] = torch.zeros_like(grad)
                state["exp_avg_sq"] = torch.zeros_like(grad)
                for side, d in enumerate(grad.shape):
                    if d <= group["max_precond_dim"]:
                        state[f"GG{side}"] = grad.new_zeros(d, d)
                _accumulate(state, grad, shampoo)
                for side in range(2):
                    if f"GG{side}" in state:
                        state[f"Q{side}"] = _eigenbasis(state[f"GG{side}"])
                continue
            q = (state.get("Q0"), state.get("Q1"))
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            projected = rotate(grad, *q)
            state["step"] += 1
            step = int(state["step"])
            exp_avg.mul_(beta1).add_(projected, alpha=1.0 - beta1)
            exp_avg_sq.mul_(beta2).add_(projected.square(), alpha=1.0 - beta2)
            denom = exp_avg_sq.sqrt().add_(group["eps"])
            step_size = group["lr"]
            if group["correct_bias"]:
                step_size = step_size * (1.0 - beta2**step) ** 0.5 / (1.0 - beta1**step)
            update = rotate_back(exp_avg / denom, *q)
            if group["normalize_grads"]:
                update = update / (1e-30 + torch.mean(update**2) ** 0.5)
            p.add_(update, alpha=-step_size)
            if group["weight_decay"] > 0.0:
                p.add_(p, alpha=-group["lr"] * group["weight_decay"])
            exp_avg.copy_(rotate_back(exp_avg, *q))
            _accumulate(state, grad, shampoo)
            if step % group["precondition_frequency"] == 0:
                _refresh(state)
            exp_avg.copy_(rotate(exp_avg, state.get("Q0"), state.get("Q1")))


def rotate(x: Tensor, q0: Tensor | None, q1: Tensor | None) -> Tensor:
    """`q0ᵀ x q1` (a missing side: the identity), x into the eigenbasis."""
    if q0 is not None:
        x = q0.mT @ x
    return x if q1 is None else x @ q1


def rotate_back(x: Tensor, q0: Tensor | None, q1: Tensor | None) -> Tensor:
    """`q0 x q1ᵀ` (a missing side: the identity), x out of the eigenbasis."""
    if q0 is not None:
        x = q0 @ x
    return x if q1 is None else x @ q1.mT


def _accumulate(state: dict, grad: Tensor, beta: float) -> None:
    """L <- lerp(L, G Gᵀ, 1 - beta), R <- lerp(R, Gᵀ G, 1 - beta), for the factors present."""
    if "GG0" in state:
        state["GG0"].lerp_(grad @ grad.mT, 1 - beta)
    if "GG1" in state:
        state["GG1"].lerp_(grad.mT @ grad, 1 - beta)


def _eigenbasis(factor: Tensor) -> Tensor:
    """Eigenvectors of a symmetric `factor`, by descending eigenvalue (eigh in float32, float64
    if that fails), in the factor's dtype."""
    matrix = factor.float()
    eye = torch.eye(matrix.shape[0], device=matrix.device, dtype=matrix.dtype)
    try:
        _, q = torch.linalg.eigh(matrix + 1e-30 * eye)
    except RuntimeError:  # did not converge
        _, q = torch.linalg.eigh(matrix.double() + 1e-30 * eye.double())
    return torch.flip(q.to(factor.dtype), [1])


def _refresh(state: dict) -> None:
    """One power iteration and a QR step per side, the bases sorted by their estimated
    eigenvalues first; V's rows or columns permuted with them."""
    exp_avg_sq = state["exp_avg_sq"]
    for side in range(2):
        if f"GG{side}" not in state:
            continue
        factor, basis = state[f"GG{side}"].float(), state[f"Q{side}"].float()
        estimated = torch.diag(basis.mT @ factor @ basis)
        order = torch.argsort(estimated, descending=True)
        exp_avg_sq.copy_(exp_avg_sq.index_select(side, order))
        q, _ = torch.linalg.qr(factor @ basis[:, order])
        state[f"Q{side}"].copy_(q)
