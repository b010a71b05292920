"""Smoke test of `wholeshard bench --quick`: every row present, the JSON schema exact.

Times are never asserted (they vary 2x on a shared machine); final losses must agree (the bench
flags them otherwise). A configuration this version of `DataParallel` cannot run, or that cannot
run a workload (torch's Muon on expert stacks), must carry its availability check's reason;
rows that ran must have every field of the right type. With `--count-launches`, BatchedMuon's
optimizer step runs a fraction of the kernels torch's Muon runs on the same matrices.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from wholeshard.bench.builders import unavailable
from wholeshard.bench.configs import CONFIGS, REFERENCE
from wholeshard.bench.rule_optimizers import KJ_RULE
from wholeshard.bench.workloads import WORKLOADS, get_workload

ROW_TYPES = {
    "workload": str,
    "config": str,
    "step_s": float,
    "optimizer_s": float,
    "comm_wait_s": float,
    "bytes_sent_per_rank": int,
    "gather_bytes_per_rank": int,
    "peak_rss_bytes": int,
    "peak_rss_delta_bytes": int,
    "optimizer_state_bytes": int,
    "persistent_bytes": int,
    "persistent_bytes_all_ranks": int,
    "ratio_vs_ddp_torch_muon": float,
    "optimizer_share": float,
    "torch_muon_owned_s": float,
    "ratio_optimizer_vs_torch_muon": float,
    "ns_flops_per_step": int,
    "ns_tflops": float,
    "ns_peak_fraction": type(None),
    "max_memory_allocated_bytes": type(None),
    "launches_per_step": type(None),
    "optimizer_launches_per_step": type(None),
    "cuda_launches_per_step": type(None),
    "optimizer_cuda_launches_per_step": type(None),
    "floor_forward_backward_s": float,
    "floor_optimizer_s": float,
    "floor_s": float,
    "ratio_vs_floor": float,
    "final_loss": float,
    "error": type(None),
    "rule": str,
    "ratio_vs_kj_rule": float,
}
PERSISTENT = ("persistent_bytes", "persistent_bytes_all_ranks")
"""Only wholeshard rows report these, and only with a `DataParallel` that has `memory()`."""
ON_CPU_NONE = ("ns_peak_fraction", "max_memory_allocated_bytes")
"""GPU figures: None on CPU (as are the launch counts without `--count-launches`)."""


def _bench(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wholeshard", "bench", "--quick", "--nproc", "2", *flags],
        capture_output=True,
        text=True,
        timeout=400,
    )


@pytest.mark.slow  # every row of the quick bench: `make soak`
def test_quick_bench_writes_every_row(tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = _bench("--json", str(out), "--png", str(png))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| workload | config |" in proc.stdout
    assert "WARNING" not in proc.stdout, proc.stdout  # a configuration's loss disagrees
    assert png.stat().st_size > 0

    doc = json.loads(out.read_text())
    assert set(doc) == {"machine", "measured", "world_size", "overrides", "results"}
    assert set(doc["measured"]) == {"date", "command", "steps", "warmup", "repeat"}
    assert doc["world_size"] == 2 and doc["overrides"] == {}
    machine = doc["machine"]
    assert isinstance(machine["cpu"], str) and isinstance(machine["torch"], str)
    assert isinstance(machine["cores"], int) and machine["cores"] >= 1
    assert (machine["device"], machine["backend"]) == ("cpu", "gloo") and "gpu" not in machine

    rows = doc["results"]
    assert [(r["workload"], r["config"]) for r in rows] == [
        (w, c) for w in WORKLOADS for c in CONFIGS
    ]
    kj_importable = importlib.util.find_spec("muon") is not None
    ran = 0
    for row in rows:
        where = f"{row['workload']}/{row['config']}"
        assert set(row) == set(ROW_TYPES), where
        config = CONFIGS[row["config"]]
        if row["config"] == "ddp_kj_muon" and not kj_importable:
            assert "muon" in row["error"], where
            continue
        reason = unavailable(config, get_workload(row["workload"], quick=True))
        if reason is not None:
            assert row["error"] == reason, where
            continue
        assert row["error"] is None, f"{where}: {row['error']}"
        ran += 1
        reports_memory = config.parallel is not None
        has_reference = unavailable(CONFIGS[REFERENCE], get_workload(row["workload"], True)) is None
        has_kj_rule = unavailable(CONFIGS[KJ_RULE], get_workload(row["workload"], True)) is None
        for key, kind in ROW_TYPES.items():
            kind = type(None) if key in PERSISTENT and not reports_memory else kind
            kind = type(None) if key == "ratio_vs_ddp_torch_muon" and not has_reference else kind
            kind = type(None) if key == "ratio_vs_kj_rule" and not has_kj_rule else kind
            assert type(row[key]) is kind, f"{where}: {key}={row[key]!r} is not {kind.__name__}"
        assert row["step_s"] > 0 and row["peak_rss_bytes"] > 0 and row["bytes_sent_per_rank"] > 0
        assert 0 <= row["peak_rss_delta_bytes"] <= row["peak_rss_bytes"], where
        assert 0 <= row["gather_bytes_per_rank"] <= row["bytes_sent_per_rank"], where
        if config.parallel is not None:  # wholeshard syncs params by all-gather or broadcast
            assert row["gather_bytes_per_rank"] > 0, where
        if reports_memory:
            assert 0 < row["persistent_bytes"] <= row["persistent_bytes_all_ranks"], where
        parts = row["floor_forward_backward_s"] + row["floor_optimizer_s"]
        assert row["floor_s"] == pytest.approx(parts), where
        assert row["ratio_vs_floor"] == pytest.approx(row["step_s"] / row["floor_s"]), where
        assert row["optimizer_share"] == pytest.approx(row["optimizer_s"] / row["step_s"])
        assert row["ratio_optimizer_vs_torch_muon"] == pytest.approx(
            row["optimizer_s"] / row["torch_muon_owned_s"]
        ), where
        assert row["ns_flops_per_step"] > 0, where
        if row["config"] == REFERENCE:
            assert row["ratio_vs_ddp_torch_muon"] == 1.0
    assert ran >= 2 * len(WORKLOADS)  # at least the reference and a wholeshard row per workload


def test_counted_launches_show_batched_muon_launches_a_fraction_of_torchs(tmp_path: Path) -> None:
    """`many-matrices --quick`: 16 matrices, 8 owned per rank, the same plan in every ws row;
    torch's Muon runs ~23 kernels per matrix, BatchedMuon ~25 per shape in all."""
    out = tmp_path / "bench.json"
    configs = ["ws_overlap", "ws_batched_muon", "ws_batched_muon_fp32"]
    flags = ["--workload", "many-matrices", "--count-launches", "--steps", "1", "--json", str(out)]
    proc = _bench(*flags, *(f"--config={c}" for c in configs))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| launches/step | opt launches |" in proc.stdout
    rows = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    for row in rows.values():
        assert row["error"] is None, row["error"]
        assert 0 < row["optimizer_launches_per_step"] < row["launches_per_step"]
        assert row["cuda_launches_per_step"] is None  # CPU
    torch_muon = rows["ws_overlap"]["optimizer_launches_per_step"]
    assert torch_muon >= 8 * 20  # every owned matrix's Newton-Schulz, one at a time
    for batched in ("ws_batched_muon", "ws_batched_muon_fp32"):
        assert rows[batched]["optimizer_launches_per_step"] < torch_muon / 2, batched
    # the forward and backward are the same model's in every row; the overlap machinery's own
    # ops (a copy or two) follow when the transfers land
    fwd_bwd = [r["launches_per_step"] - r["optimizer_launches_per_step"] for r in rows.values()]
    assert max(fwd_bwd) - min(fwd_bwd) <= 4, fwd_bwd
