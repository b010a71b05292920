"""Smoke test of `wholeshard bench --quick`: every row present, the JSON schema exact.

Times are never asserted (they vary 2x on a shared machine); final losses must agree (the bench
flags them otherwise). A configuration this version of `DataParallel` cannot run must carry its
availability check's reason; rows that ran must have every field of the right type.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from wholeshard.bench.configs import CONFIGS, REFERENCE
from wholeshard.bench.workloads import WORKLOADS

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
    "floor_forward_backward_s": float,
    "floor_optimizer_s": float,
    "floor_s": float,
    "ratio_vs_floor": float,
    "final_loss": float,
    "error": type(None),
}
PERSISTENT = ("persistent_bytes", "persistent_bytes_all_ranks")
"""Only wholeshard rows report these, and only with a `DataParallel` that has `memory()`."""


def test_quick_bench_writes_every_row(tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "wholeshard", "bench", "--quick", "--nproc", "2"]
        + ["--json", str(out), "--png", str(png)],
        capture_output=True,
        text=True,
        timeout=240,
    )
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
        assert row["error"] is None, f"{where}: {row['error']}"
        ran += 1
        reports_memory = config.parallel is not None
        for key, kind in ROW_TYPES.items():
            kind = type(None) if key in PERSISTENT and not reports_memory else kind
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
        if row["config"] == REFERENCE:
            assert row["ratio_vs_ddp_torch_muon"] == 1.0
    assert ran >= 2 * len(WORKLOADS)  # at least the reference and a wholeshard row per workload
