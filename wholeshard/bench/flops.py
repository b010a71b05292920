"""Newton–Schulz arithmetic and GPU peaks, for the Newton–Schulz TFLOP/s figure.

The flops of one update are `capacity.projection.ns_flops` (the one count): the products of
`torch.optim.Muon`'s `_zeropower_via_newtonschulz` (and of `BatchedMuon`, `MuonWithAuxAdam`),
not its O(m n) scalings, additions and norm. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..capacity.projection import ns_flops

BF16_DENSE_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM (HBM3): its name says neither PCIe nor NVL
    ("H200", 989.0),  # and GH200
    ("A100", 312.0),
)
"""Dense (no sparsity) bf16 tensor-core peaks by a substring of `torch.cuda.get_device_name`,
first match wins (NVIDIA's data sheets)."""


def total_ns_flops(shapes: Iterable[Sequence[int]]) -> int:
    return sum(ns_flops(s) for s in shapes)


def bf16_peak_tflops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak in TFLOP/s by its name, None when the table does not know it."""
    for key, peak in BF16_DENSE_PEAK_TFLOPS:
        if key in device_name:
            return peak
    return None
