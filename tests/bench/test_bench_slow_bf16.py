"""`wholeshard bench` on a CPU without fast bf16 matmuls (no AVX512-BF16, no AMX), whatever CPU
runs the test: the detector is monkeypatched and no worker starts."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

import wholeshard.cli.bench as cli_bench
from wholeshard.bench import floor, machine, report, slow_bf16
from wholeshard.bench.builders import every_param
from wholeshard.bench.configs import CONFIGS, WORKLOADS
from wholeshard.bench.timing import Timer
from wholeshard.bench.workloads import get_workload
from wholeshard.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, bool]]:
    """Every configuration gets an error row instead of workers; returns what was asked for."""
    asked: list[tuple[str, str, bool]] = []

    def fake(workload: str, config: str, *args):
        asked.append((workload, config, args[-1]))  # the last: whether to time the yardstick
        return report.Row(workload, config, error="not run in this test"), []

    monkeypatch.setattr(cli_bench, "_run_one", fake)
    return asked


def _bench(argv: str) -> int:
    args = build_parser().parse_args(["bench", *argv.split()])
    return args.run(args)


def _commands(text: str) -> list[str]:
    return re.findall(r"`(wholeshard bench [^`]*)`", text)


def test_the_run_says_so_first_and_offers_the_fp32_comparison(
    monkeypatch, no_workers, tmp_path, capfd
) -> None:
    monkeypatch.setattr(machine, "cpu_bf16_matmul", lambda: machine.SLOW_BF16)
    out = tmp_path / "bench.json"
    argv = "--workload all --config ddp_torch_muon --config ws_batched_muon_fp32 --json"
    assert _bench(f"{argv} {out}") == 0
    captured = capfd.readouterr()
    notes = [line for line in captured.err.splitlines() if line.startswith("[bench] note: ")]
    assert captured.err.startswith(notes[0]), "the note comes before the first configuration"
    assert "has no AVX512-BF16 or AMX" in notes[0] and "ws_batched_muon_fp32" in notes[0]
    assert "full-size mlp cannot finish" in notes[1]
    commands = _commands(notes[1])
    assert commands == [
        "wholeshard bench --workload mlp --config ws_batched_muon_fp32",
        "wholeshard bench --workload many-matrices",
    ]
    assert "mlp rows leave out torch's Muon yardstick" in notes[2] and len(notes) == 3
    assert "bf16 matmuls on a slow path (no AVX512-BF16, no AMX)" in captured.out  # the footer
    assert json.loads(out.read_text())["machine"]["cpu_bf16_matmul"] == "none"
    yardstick = {(w, c): y for w, c, y in no_workers}
    assert len(yardstick) == 8 and not yardstick["mlp", "ws_batched_muon_fp32"]
    assert [k for k, y in yardstick.items() if not y] == [
        ("mlp", "ddp_torch_muon"),
        ("mlp", "ws_batched_muon_fp32"),
    ]


@pytest.mark.parametrize("kind", ["AMX", "AVX512-BF16", "unknown"])
def test_a_cpu_with_fast_or_unknown_bf16_gets_no_note(
    monkeypatch, no_workers, tmp_path, capfd, kind: str
) -> None:
    monkeypatch.setattr(machine, "cpu_bf16_matmul", lambda: kind)
    out = tmp_path / "bench.json"
    assert _bench(f"--workload mlp --config ws_overlap --json {out}") == 0
    captured = capfd.readouterr()
    assert "note:" not in captured.err and "slow path" not in captured.out
    assert json.loads(out.read_text())["machine"]["cpu_bf16_matmul"] == kind
    assert no_workers == [("mlp", "ws_overlap", True)]


def test_the_offered_commands_are_valid_and_avoid_full_size_bf16_rows() -> None:
    every = list(CONFIGS)
    for lines in (
        slow_bf16.header("cpu", ["mlp"], every, quick=False),
        slow_bf16.header("cpu", ["gpt", "mlp"], ["ws_overlap"], quick=False),
    ):
        for command in _commands(" ".join(lines)):
            args = build_parser().parse_args(shlex.split(command)[1:])
            configs = args.config or every
            if args.workload in slow_bf16.CANNOT_FINISH:
                assert set(configs) <= set(slow_bf16.fp32_configs()), command


@pytest.mark.parametrize(
    "workloads, configs, quick, advice",
    [
        (["mlp"], ["ws_overlap"], False, "cannot finish"),
        (["mlp"], ["ws_overlap"], True, "add --config ws_batched_muon_fp32"),
        (["gpt"], ["ddp_torch_muon"], False, "add --config ws_batched_muon_fp32"),
        (["gpt", "mlp"], ["ws_batched_muon_fp32"], False, None),
        (["gpt"], ["ws_overlap", "ws_batched_muon_fp32"], False, None),
    ],
)
def test_the_advice_fits_the_run(workloads, configs, quick, advice) -> None:
    lines = slow_bf16.header("AMD EPYC", workloads, configs, quick)
    assert lines[0].startswith("AMD EPYC has no AVX512-BF16 or AMX")
    if advice is None:
        assert lines[1:2] == [] or "yardstick" in lines[1]
    else:
        assert advice in lines[1]
    assert ("yardstick" in lines[-1]) == ("mlp" in workloads and not quick)


def test_without_the_yardstick_the_floor_times_no_torch_muon(monkeypatch) -> None:
    """The yardstick alone outlasts a configuration's time limit on such a CPU (4 bf16
    Newton-Schulz a rank a step on mlp): left out, it is not even built."""

    def refuse(*args, **kwargs):
        raise AssertionError("the yardstick was built")

    workload = get_workload("mlp", quick=True)
    model = workload.make_model()
    batches = [workload.local_batch(s, 0, 1) for s in range(3)]
    args = (model, workload, every_param, batches, 1, Timer(torch.device("cpu")))
    assert floor.measure(*args)["torch_muon_owned_s"] > 0
    monkeypatch.setattr(floor, "torch_muon", refuse)
    figures = floor.measure(*args, yardstick=False)
    assert figures["torch_muon_owned_s"] is None and figures["floor_optimizer_s"] > 0


@pytest.mark.parametrize(
    "arch, amx, avx512_bf16, expected",
    [
        ("x86_64", True, True, "AMX"),
        ("x86_64", False, True, "AVX512-BF16"),
        ("x86_64", False, False, "none"),
        ("aarch64", False, False, "unknown"),
    ],
)
def test_the_detector_reads_the_cpu_flags(monkeypatch, arch, amx, avx512_bf16, expected) -> None:
    monkeypatch.setattr(machine.platform, "machine", lambda: arch)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert machine.cpu_bf16_matmul() == expected


def test_the_docs_show_the_notes_a_full_run_prints() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    lines = slow_bf16.header("AMD EPYC", list(WORKLOADS), list(CONFIGS), quick=False)
    assert "\n".join(f"[bench] note: {line}" for line in lines) in page
