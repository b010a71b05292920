"""Newton–Schulz arithmetic and GPU peaks, for the Newton–Schulz TFLOP/s figure.

`torch.optim.Muon`'s `_zeropower_via_newtonschulz` (and `BatchedMuon`, `MuonWithAuxAdam`) runs
on an (m, n) matrix with m <= n (a tall one is transposed first), per iteration:
`G = X X^T` (2 m m n flops), `addmm(G, G, G)` (2 m^3), `addmm(X, G', X)` (2 m m n), so
`steps * (4 m^2 n + 2 m^3)` in all (`capacity.projection.ns_flops`, the one count). Only these
products count: the scalings, additions and the norm are O(m n) per iteration. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..capacity.projection import NS_STEPS, ns_flops  # the one count of Newton-Schulz flops

BF16_DENSE_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM (HBM3): its name says neither PCIe nor NVL
    ("H200", 989.0),  # and GH200
    ("A100", 312.0),
)
"""Dense (no sparsity) bf16 tensor-core peaks by a substring of `torch.cuda.get_device_name`,
first match wins (NVIDIA's data sheets)."""


def total_ns_flops(shapes: Iterable[Sequence[int]], steps: int = NS_STEPS) -> int:
    return sum(ns_flops(s, steps) for s in shapes)


def bf16_peak_tflops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak in TFLOP/s by its name, None when the table does not know it."""
    for key, peak in BF16_DENSE_PEAK_TFLOPS:
        if key in device_name:
            return peak
    return None
