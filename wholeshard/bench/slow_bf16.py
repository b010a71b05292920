"""What `wholeshard bench` tells a user whose CPU has no fast bf16 matmuls (no AVX512-BF16, no
AMX: `machine.cpu_bf16_matmul()` is `SLOW_BF16`), before the first worker starts.

The workloads compute in fp32, but Newton-Schulz runs in bf16 in every Muon configuration
except the fp32-products ones (`BatchedMuon(matmul_dtype=torch.float32)`), and on such a CPU a
bf16 GEMM takes a path tens of times slower than fp32's. On the full-size `mlp` (1024x1024
matrices) one bf16 Newton-Schulz then takes tens of seconds, so its bf16 rows run into their
timeout; the other workloads' small matrices finish, slowly. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

from .configs import CONFIGS

CANNOT_FINISH = ("mlp",)
"""Workloads whose bf16 Newton-Schulz rows cannot finish at full size on such a CPU."""
SMALL_MATRICES = "many-matrices"
"""The workload to compare every row on there: 64x64 matrices, where bf16 rows finish."""


def cannot_finish(workload: str, quick: bool) -> bool:
    """Whether `workload` (`quick`: its small version) is out of reach of bf16 Newton-Schulz on
    such a CPU. Its runs leave out the torch-Muon yardstick (`floor.py`), which alone would take
    longer than a configuration may, so that its fp32-products rows finish."""
    return workload in CANNOT_FINISH and not quick


def fp32_configs() -> list[str]:
    """The configurations whose Newton-Schulz sums its products in fp32 GEMMs."""
    return [c.name for c in CONFIGS.values() if c.matrix_optimizer == "batched_fp32"]


def header(cpu: str, workloads: Sequence[str], configs: Sequence[str], quick: bool) -> list[str]:
    """The lines a run of `configs` on `workloads` starts with on CPU `cpu` without fast bf16:
    what that costs, and the command to run instead where a workload cannot finish."""
    fp32 = fp32_configs()
    names = " ".join(f"--config {c}" for c in fp32)
    lines = [
        f"{cpu} has no AVX512-BF16 or AMX: its bf16 matmuls take a slow path (tens of times "
        f"fp32's time), and Muon's Newton-Schulz runs in bf16 in every configuration but "
        f"{', '.join(fp32)} (BatchedMuon(matmul_dtype=torch.float32): fp32 products)"
    ]
    stuck = [w for w in workloads if cannot_finish(w, quick)]
    if stuck and any(c not in fp32 for c in configs):
        lines.append(
            f"the full-size {', '.join(stuck)} cannot finish its bf16 rows here (one 1024x1024 "
            f"bf16 Newton-Schulz takes tens of seconds, for every matrix at every step): run "
            f"`wholeshard bench --workload {stuck[0]} {names}` for it on fp32 products, or "
            f"`wholeshard bench --workload {SMALL_MATRICES}` to compare every row on 64x64 "
            f"matrices"
        )
    elif not set(fp32) & set(configs):
        lines.append(f"add {names} to include the fp32 products (no bf16 GEMM)")
    if stuck:
        lines.append(
            f"{', '.join(stuck)} rows leave out torch's Muon yardstick (torch_muon_owned_s, "
            f"opt vs torch Muon): it alone would take longer than a configuration may"
        )
    return lines
