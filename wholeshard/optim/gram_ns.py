"""Gram Newton–Schulz: the Newton–Schulz iteration of `normuon.orthogonalize` with the same
coefficients and fewer flops, batched over any leading dims (`ns_algorithm="gram"`).

The standard step on a wide X (m, n), m <= n, is X <- a X + (b A + c A²) X with A = X Xᵀ:
`4 m² n + 2 m³` flops. Two savings, chosen per shape by their flop count (`gram_ns_flops`):

- symmetric products ("syrk"): A = X Xᵀ and A² = A Aᵀ are symmetric, so only the upper
  block triangle is multiplied (row blocks of `SYRK_BLOCK`) and mirrored, the idea of
  Megatron's SYRK option. The iteration, its dtypes and its bf16 rounding points are the
  standard one's; only the GEMMs' summation order differs. 25% fewer flops on 1024 x 1024.
- the Gram form ("gram"), after dion's Gram Newton–Schulz: every X_k = Q_k X_0 with Q_k a
  polynomial in R_0 = X_0 X_0ᵀ, so iterate on the m x m matrices R (R <- P R P) and Q
  (Q <- P Q), P = a I + b R + c R², touching the wide X only to form R and to apply Q.
  Q_k X_0 amplifies X_0's small singular directions (up to about a^k), so rounding errors of
  R_0 grow with k: as dion does, the form restarts once, at iteration `RESTART`
  (X <- Q X, R <- X Xᵀ, Q <- I), which bounds the amplification by that of a few steps.
  Cheaper than syrk when n is about 2 m or more.

Dtypes: the input and output are bf16 and every product takes bf16 operands and rounds its
result to bf16, as in the standard form ("gram" also symmetrizes R after each update, which
rounding would otherwise skew). Products whose right operand is not a transpose take it
transposed-contiguous (`_mm`), the layout CPU bf16 GEMMs are fast in (about 8x on CPUs without
bf16 GEMM units). The result is not the standard's bit for bit: on random matrices it differs
by up to 0.10 relative Frobenius (the two torch forms of the standard iteration differ by up to
0.05), within the standard's singular-value band widened by 0.1
(tests/optim/test_gram_ns.py bounds both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from torch import Tensor

Coefficients = tuple[float, float, float]
NsAlgorithm = Literal["standard", "gram"]
NS_ALGORITHMS = ("standard", "gram")

SYRK_BLOCK = 256
"""Rows per block of a symmetric product; a matrix of at most this many rows is one GEMM."""
RESTART = 2
"""The Gram form recomputes X and R before this iteration (when it has more steps)."""


def check_ns_algorithm(ns_algorithm: str) -> str:
    """`ns_algorithm` if it is one of `NS_ALGORITHMS`, else ValueError."""
    if ns_algorithm not in NS_ALGORITHMS:
        raise ValueError(f"ns_algorithm must be one of {NS_ALGORITHMS}, got {ns_algorithm!r}")
    return ns_algorithm


def symmetric_gram(x: Tensor) -> Tensor:
    """x xᵀ for x (..., m, n) in x's dtype, exactly symmetric: block row i is multiplied with
    rows i * `SYRK_BLOCK` onwards only, and the lower block triangle is its mirror."""
    m = x.size(-2)
    if m <= SYRK_BLOCK:
        return x @ x.mT
    out = x.new_empty(*x.shape[:-2], m, m)
    for lo in range(0, m, SYRK_BLOCK):
        hi = min(m, lo + SYRK_BLOCK)
        block = x[..., lo:hi, :] @ x[..., lo:, :].mT
        out[..., lo:hi, lo:] = block
        out[..., lo:, lo:hi] = block.mT
    return out


def _symmetric_flops(m: int, n: int) -> int:
    """`symmetric_gram`'s flops on an (m, n) matrix."""
    return sum(2 * (min(m, lo + SYRK_BLOCK) - lo) * (m - lo) * n for lo in range(0, m, SYRK_BLOCK))


def _segments(steps: int) -> list[int]:
    """The Gram form's run lengths: `steps` split at `RESTART`."""
    return [RESTART, steps - RESTART] if steps > RESTART else [steps]


def _plan_flops(m: int, n: int, steps: int) -> dict[str, int]:
    """Product flops of one (m, n) matrix, m <= n, under each plan."""
    syrk = steps * (_symmetric_flops(m, n) + _symmetric_flops(m, m) + 2 * m * m * n)
    gram = 0
    for length in _segments(steps):
        gram += _symmetric_flops(m, n) + 2 * m * m * n  # R = X Xᵀ, then X = Q X
        gram += length * _symmetric_flops(m, m) + (length - 1) * 6 * m**3  # R², Q and R updates
    return {"syrk": syrk, "gram": gram}


def gram_plan(m: int, n: int, steps: int) -> str:
    """ "gram" or "syrk": the cheaper plan for a wide (m, n) matrix (m <= n); ties go to syrk."""
    flops = _plan_flops(m, n, steps)
    return "gram" if flops["gram"] < flops["syrk"] else "syrk"


def gram_ns_flops(shape: Sequence[int], steps: int) -> int:
    """Product flops of `gram_newton_schulz` on one matrix of `shape` (either orientation)."""
    m, n = sorted(shape[-2:])
    return min(_plan_flops(m, n, steps).values())  # the plan's: the cheaper


def gram_newton_schulz(x: Tensor, schedule: Sequence[Coefficients]) -> Tensor:
    """The Newton–Schulz iterations `schedule` ((a, b, c) per step) on the bf16 stack `x`
    (..., m, n), m <= n, already normalized; returns bf16 (..., m, n). See the module note."""
    m, n = x.shape[-2:]
    if m > n:
        raise ValueError(f"gram_newton_schulz takes wide matrices (m <= n), got {(m, n)}")
    x = x.bfloat16()
    if gram_plan(m, n, len(schedule)) == "syrk":
        return _syrk_iterations(x, schedule)
    return _gram_iterations(x, schedule)


def _syrk_iterations(x: Tensor, schedule: Sequence[Coefficients]) -> Tensor:
    """The standard iteration with both Gram products symmetric."""
    for a, b, c in schedule:
        gram = symmetric_gram(x)
        poly = symmetric_gram(gram).mul_(c).add_(gram, alpha=b)
        x = _mm(poly, x).add_(x, alpha=a)
    return x


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with b's transpose made contiguous: the same product, in the (A, Bᵀ) layout that
    CPU bf16 GEMMs run several times faster (a copy of O(b.numel()))."""
    return a @ b.mT.contiguous().mT


def _gram_iterations(x: Tensor, schedule: Sequence[Coefficients]) -> Tensor:
    """Q and R on the m x m side, X <- Q X at the restart and at the end."""
    steps = 0
    for length in _segments(len(schedule)):
        r = symmetric_gram(x)
        q = r  # placeholder: replaced at j == 0
        for j, (a, b, c) in enumerate(schedule[steps : steps + length]):
            z = symmetric_gram(r).mul_(c).add_(r, alpha=b)  # P = a I + Z
            if j == 0:  # Q = P
                q = z.clone()
                q.diagonal(dim1=-2, dim2=-1).add_(a)
            else:
                q = _mm(z, q).add_(q, alpha=a)
            if j < length - 1:
                zr = _mm(z, r).add_(r, alpha=a)  # P R
                r = _mm(z, zr).add_(zr, alpha=a)  # P R P
                r = (r + r.mT).mul_(0.5)
        steps += length
        x = _mm(q, x)
    return x
