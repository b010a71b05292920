"""The train job's Newton-Schulz implementation (`wholeshard.train.newton_schulz`): what each
name builds, and `auto` choosing by the machine's features, whatever its timings say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_faults import Loaded, metrics, micro_argv, train_job

from wholeshard.optim import BatchedMuon
from wholeshard.optim.normuon import Muon
from wholeshard.train import newton_schulz as ns

CPU = torch.device("cpu")
SHAPES = [(48, 16)] * 6 + [(16, 16)] * 3 + [(16, 48)] * 2


def test_each_name_builds_its_implementation() -> None:
    assert ns.implementation("torch_bf16").rule is torch.optim.Muon
    assert ns.implementation("torch_bf16", "polar_express").rule is Muon
    fp32 = ns.implementation("batched_fp32")
    assert (fp32.rule, fp32.kwargs) == (BatchedMuon, {"matmul_dtype": torch.float32})
    gram = ns.implementation("batched_bf16", ns_algorithm="gram")
    assert gram.kwargs == {"matmul_dtype": torch.bfloat16, "ns_algorithm": "gram"}
    with pytest.raises(ValueError, match="--newton-schulz torch_bf16"):
        ns.implementation("batched_fp32", "polar_express")
    with pytest.raises(ValueError, match="one of"):
        ns.implementation("fp64")


def test_a_named_implementation_is_not_measured() -> None:
    chosen = ns.choose("batched_bf16", SHAPES, CPU)
    assert (chosen.name, chosen.measured, chosen.figures()) == ("batched_bf16", None, None)
    assert "--newton-schulz" in chosen.describe()


MACHINES = [  # (device, the CPU's bf16 matmul units, auto's choice)
    ("cpu", "AMX", "torch_bf16"),
    ("cpu", "AVX512-BF16", "torch_bf16"),
    ("cpu", "none", "batched_fp32"),
    ("cpu", "unknown", "torch_bf16"),
    ("cuda", "none", "torch_bf16"),  # (a GPU's host CPU does not matter)
]
ADVERSARIAL = [  # timings that would have chosen each implementation, by any margin
    {"torch_bf16": 1e-4, "batched_bf16": 1.0, "batched_fp32": 1.0},
    {"torch_bf16": 1.0, "batched_bf16": 1e-4, "batched_fp32": 1.0},
    {"torch_bf16": 1.0, "batched_bf16": 1.0, "batched_fp32": 1e-4},
    {"torch_bf16": 0.023, "batched_bf16": 0.030, "batched_fp32": 0.016},  # a close call
]


@pytest.mark.parametrize("device, units, expected", MACHINES)
def test_auto_is_the_machines_choice_whatever_the_timings(
    monkeypatch, device: str, units: str, expected: str
) -> None:
    """The same machine gets the same implementation under any load: timings that favour each
    implementation in turn (a loaded machine's), a close call, leave the choice where the
    device and the CPU's bf16 units put it."""
    monkeypatch.setattr(ns, "cpu_bf16_matmul", lambda: units)
    for timings in ADVERSARIAL:
        limits = {}

        def timed(impl, groups, device, limit, timings=timings, limits=limits):
            limits[impl.name] = limit
            return timings[impl.name], len(groups) if timings[impl.name] <= limit else 1

        monkeypatch.setattr(ns, "step_seconds", timed)
        chosen = ns.choose("auto", SHAPES, torch.device(device))
        assert chosen.name == expected == ns.machine_choice(torch.device(device))[0]
        assert chosen.kwargs == ns.implementation(expected).kwargs
        assert list(chosen.measured.seconds) == list(ns.IMPLEMENTATIONS)  # all timed, in order
        assert limits["torch_bf16"] == ns.BUDGET_S  # it sets the sample; the others stop past
        first = timings["torch_bf16"]  # 10x its time
        assert all(limits[n] == ns.SLOWER * first for n in limits if n != "torch_bf16")
        stopped = tuple(n for n in ns.IMPLEMENTATIONS if timings[n] > ns.SLOWER * first)
        assert chosen.measured.stopped == stopped
        line = chosen.describe()
        assert line.startswith(f"newton-schulz {expected} (auto): {chosen.why}")
        assert "does not decide it" in line and all(f"{n} >" in line for n in stopped)
        assert chosen.figures() == {
            "why": chosen.why,
            "seconds": timings,
            "stopped": list(stopped),
        }


def test_auto_says_why() -> None:
    """Each machine's reason names what decided it."""
    why = {}
    for device, units, _ in MACHINES:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(ns, "cpu_bf16_matmul", lambda units=units: units)
            why[device, units] = ns.machine_choice(torch.device(device))[1]
    assert "AMX runs bf16 products at full rate" in why["cpu", "AMX"]
    assert "neither AVX512-BF16 nor AMX" in why["cpu", "none"]
    assert "unknown" in why["cpu", "unknown"] and "batched_fp32" in why["cpu", "unknown"]
    assert "cuda" in why["cuda", "none"]


def test_auto_times_each_candidate_here() -> None:
    chosen = ns.choose("auto", SHAPES, CPU)
    assert chosen.name == ns.machine_choice(CPU)[0]
    assert list(chosen.measured.seconds) == list(ns.IMPLEMENTATIONS)
    assert all(s > 0 for s in chosen.measured.seconds.values())
    assert "ms" in chosen.describe()
    # only torch's Muon runs Polar Express: nothing to time
    polar = ns.choose("auto", SHAPES, CPU, "polar_express")
    assert (polar.name, polar.measured) == ("torch_bf16", None)
    assert "only torch's Muon runs --ns-coefficients polar_express" in polar.describe()
    gram = ns.choose("auto", SHAPES, CPU, ns_algorithm="gram")  # products bf16 either way
    assert gram.name == "torch_bf16" and list(gram.measured.seconds) == list(ns.IMPLEMENTATIONS[:2])


def test_the_sample_probes_one_matrix_then_the_rest_cheapest_first() -> None:
    groups = ns.sample_groups(SHAPES)
    assert groups == [[(16, 16)], [(16, 16)] * 2, [(48, 16)] * 4, [(16, 48)] * 2]


def test_a_slow_implementation_is_stopped_early() -> None:
    groups = ns.sample_groups(SHAPES)
    total, ran = ns.step_seconds(ns.implementation("torch_bf16"), groups, CPU, limit=0.0)
    assert ran == 1 and total > 0
    _, ran = ns.step_seconds(ns.implementation("torch_bf16"), groups, CPU, limit=float("inf"))
    assert ran == len(groups)


def test_auto_keeps_the_resumed_runs_choice_without_measuring(monkeypatch) -> None:
    def measured(*args, **kwargs):
        raise AssertionError("auto measured where the resumed run's choice holds")

    monkeypatch.setattr(ns, "step_seconds", measured)
    kept = ns.choose("auto", SHAPES, CPU, resumed="batched_fp32")
    assert (kept.name, kept.resumed, kept.measured, kept.figures()) == (
        "batched_fp32",
        True,
        None,
        None,
    )
    assert kept.kwargs == {"matmul_dtype": torch.float32}
    assert "resumed run's choice" in kept.describe()
    # a choice auto could not make now (only torch's Muon runs Polar Express) is not kept
    assert ns.choose("auto", SHAPES, CPU, "polar_express", resumed="batched_bf16").name == (
        "torch_bf16"
    )


def test_one_command_gives_the_same_bits_under_load_and_after_a_restart(
    tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture
) -> None:
    """Two runs of one `wholeshard train` command (`--newton-schulz auto`, the default): one
    whose timings favour torch's Muon, and one whose timings favour `batched_fp32` (what a
    loaded machine at its worst can measure: `Loaded` sets the timings, so no real load is
    needed to get them), a worker of it killed before its first checkpoint and the job
    restarted. The same implementation, the same losses to the bit."""

    def run(name: str, loaded: Loaded) -> tuple[dict, list]:
        out = tmp_path / name
        argv = micro_argv(text_file, out, 3, 3, "--no-progress", "--log-every", "1", "--nproc", "1")
        argv += ["--newton-schulz", "auto", "--max-restarts", "1", "--checkpoint-every", "3"]
        result = train_job(argv, out, loaded)
        assert result["code"] == 0
        return result["summary"], metrics(out)

    quiet, quiet_records = run("quiet", Loaded("torch_bf16"))
    marker = tmp_path / "killed"
    loaded, loaded_records = run("loaded", Loaded("batched_fp32", str(marker), victim=0))
    assert marker.read_text() == "killed before the checkpoint of step 0"
    assert "Restart 1/1 from the start (no checkpoint yet)" in capsys.readouterr().err
    assert quiet["newton_schulz"] == loaded["newton_schulz"] == ns.machine_choice(CPU)[0]
    timed = quiet["newton_schulz_auto"]["seconds"], loaded["newton_schulz_auto"]["seconds"]
    assert min(timed[0], key=timed[0].get) == "torch_bf16"  # the timings disagreed ...
    assert min(timed[1], key=timed[1].get) == "batched_fp32"

    def losses(records: list) -> list:
        return [(r["step"], r.get("loss"), r.get("val_loss")) for r in records if "step" in r]

    assert [s for s, *_ in losses(quiet_records)] == [0, 1, 2, 3]
    assert losses(loaded_records) == losses(quiet_records)  # ... the bits did not
