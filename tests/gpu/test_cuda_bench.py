"""`wholeshard bench --device cuda` on one GPU (the GPU tier, marker `cuda`): world size 1 on
NCCL, and two ranks sharing the GPU over gloo. Every test skips without CUDA.

Times are never asserted; what is: the GPU fields are there and consistent with each other
(TFLOP/s is the Newton–Schulz flops over the optimizer time, the peak fraction that over the
table's peak), the losses agree, and BatchedMuon's optimizer step launches a fraction of the
kernels torch's Muon launches on the same matrices (counted from the CUDA launch calls).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import run_cuda

from wholeshard.bench.exchange_bucket import exchange_bucket_row
from wholeshard.bench.flops import bf16_peak_tflops
from wholeshard.bench.owner_bucket import largest_numel, owner_bucket_row

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _bench(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "wholeshard", "bench", "--device", "cuda", "--quick"]
        + [*flags, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| max alloc MB | NS TFLOP/s | of bf16 peak |" in proc.stdout
    assert "WARNING" not in proc.stdout, proc.stdout  # a configuration's loss disagrees
    return json.loads(out.read_text())


def _check_gpu_row(row: dict, peak: float | None) -> None:
    where = row["config"]
    assert row["error"] is None, f"{where}: {row['error']}"
    assert type(row["max_memory_allocated_bytes"]) is int, where
    assert row["max_memory_allocated_bytes"] > 0, where
    assert 0 < row["optimizer_s"] <= row["step_s"], where
    assert row["optimizer_share"] == pytest.approx(row["optimizer_s"] / row["step_s"]), where
    assert row["ns_flops_per_step"] > 0, where
    rate = row["ns_flops_per_step"] / row["optimizer_s"] / 1e12
    assert row["ns_tflops"] == pytest.approx(rate), where
    if peak is None:
        assert row["ns_peak_fraction"] is None, where
    else:
        assert row["ns_peak_fraction"] == pytest.approx(row["ns_tflops"] / peak), where
    assert row["torch_muon_owned_s"] > 0, where


def test_world_size_1_on_nccl_reports_the_gpu_figures(tmp_path: Path) -> None:
    configs = ["ddp_torch_muon", "ws_overlap", "ws_batched_muon"]
    doc = _bench(
        tmp_path,
        *("--nproc", "1", "--workload", "many-matrices", "--count-launches"),
        *(f"--config={c}" for c in configs),
    )
    machine = doc["machine"]
    assert (machine["device"], machine["backend"]) == ("cuda", "nccl")
    assert machine["gpu"] == torch.cuda.get_device_name()
    assert machine["gpu_bf16_peak_tflops"] == bf16_peak_tflops(machine["gpu"])
    rows = {r["config"]: r for r in doc["results"]}
    assert list(rows) == configs
    for row in rows.values():
        _check_gpu_row(row, machine["gpu_bf16_peak_tflops"])
        assert 0 < row["optimizer_cuda_launches_per_step"] <= row["cuda_launches_per_step"]
        assert 0 < row["optimizer_launches_per_step"] <= row["launches_per_step"]
    # 16 matrices on the one rank: torch's Muon launches ~23 kernels for each, BatchedMuon
    # about as many for the whole batch
    torch_muon = rows["ws_overlap"]["optimizer_cuda_launches_per_step"]
    assert torch_muon >= 16 * 20
    assert rows["ws_batched_muon"]["optimizer_cuda_launches_per_step"] < torch_muon / 4


def test_ranks_sharing_the_gpu_run_over_gloo(tmp_path: Path) -> None:
    configs = ["ws_sync", "ws_batched_muon_fp32"]
    doc = _bench(
        tmp_path,
        *("--nproc", "2", "--workload", "mlp"),
        *(f"--config={c}" for c in configs),
    )
    machine = doc["machine"]
    expected = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    assert (machine["device"], machine["backend"], doc["world_size"]) == ("cuda", expected, 2)
    rows = doc["results"]
    assert [r["config"] for r in rows] == configs
    for row in rows:
        _check_gpu_row(row, machine["gpu_bf16_peak_tflops"])
        assert row["launches_per_step"] is None  # not asked for


def test_one_owner_bucket_at_the_largest_size_the_gpu_holds() -> None:
    """One owner bucket reduced to its owners and gathered back ([Note: owner collectives]) on
    CUDA tensors, at the largest size the GPU holds for its ranks: NCCL when each of the 2 ranks
    has a GPU, else both on one over gloo. The values are exact; the rows (times never
    asserted) go to runs/gpu_owner_bucket.json, the GPU tier's measurement of the form."""
    nproc = 2
    backend = "nccl" if torch.cuda.device_count() >= nproc else "gloo"
    numel = largest_numel(torch.device("cuda"), 1 if backend == "nccl" else nproc)
    rows = []
    for owners in ("every", "one"):
        out = run_cuda(owner_bucket_row, nproc, numel, "cuda", owners, backend=backend)
        assert all(r["exact"] and r["backend"] == backend for r in out), out
        rows.append(out[0])
    (REPO / "runs").mkdir(exist_ok=True)
    (REPO / "runs" / "gpu_owner_bucket.json").write_text(json.dumps(rows, indent=1) + "\n")


def test_one_exchange_bucket_against_the_reduce_scatter_on_cuda() -> None:
    """One exchange bucket ([Note: exchange buffers]) on CUDA tensors: its reduce-scatter, the
    all-to-all of the reduced pieces to their owners, the all-to-all back and the all-gather,
    at world size 1 on NCCL (nothing to move) and at 2 ranks (NCCL where each has a GPU, else
    both on one over gloo). The values are exact; the rows (times never asserted) go to
    runs/gpu_exchange_bucket.json: the grads' direction (reduce-scatter + exchange) over the
    reduce-scatter alone (`reduce_scatter_tensor`) at each size."""
    rows = []
    two = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    for nproc, backend in ((1, "nccl"), (2, two)):
        for mb in (16, 256):
            out = run_cuda(exchange_bucket_row, nproc, mb, "cuda", backend=backend)
            assert all(r["exact"] and r["backend"] == backend for r in out), out
            assert (out[0]["moved"] > 0) == (nproc > 1), out[0]
            rows.append(out[0])
    (REPO / "runs").mkdir(exist_ok=True)
    (REPO / "runs" / "gpu_exchange_bucket.json").write_text(json.dumps(rows, indent=1) + "\n")
