"""The train job's Newton-Schulz implementation (`wholeshard.train.newton_schulz`): what each
name builds, and `auto` choosing by a bounded measurement."""

from __future__ import annotations

import pytest
import torch

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
    assert (chosen.name, chosen.seconds) == ("batched_bf16", {})
    assert "--newton-schulz" in chosen.describe()


def test_auto_measures_each_and_keeps_torchs_muon_on_a_close_call() -> None:
    chosen = ns.choose("auto", SHAPES, CPU)
    assert set(chosen.seconds) == set(ns.IMPLEMENTATIONS)
    default = chosen.seconds["torch_bf16"]
    if chosen.name == "torch_bf16":
        assert all(t * ns.MARGIN > default for t in chosen.seconds.values())
    else:
        assert chosen.seconds[chosen.name] == min(chosen.seconds.values())
        assert chosen.seconds[chosen.name] * ns.MARGIN <= default
    assert chosen.name in chosen.describe() and "ms" in chosen.describe()
    # only torch's Muon runs Polar Express: nothing to measure
    assert ns.choose("auto", SHAPES, CPU, "polar_express").name == "torch_bf16"
    gram = ns.choose("auto", SHAPES, CPU, ns_algorithm="gram")  # products bf16 either way
    assert set(gram.seconds) == {"batched_bf16", "torch_bf16"}


@pytest.mark.parametrize(
    "measured, chosen",
    [
        ({"torch_bf16": 1.0, "batched_bf16": 0.8, "batched_fp32": 0.5}, "batched_fp32"),
        ({"torch_bf16": 1.0, "batched_bf16": 0.6, "batched_fp32": 0.7}, "batched_bf16"),
        ({"torch_bf16": 1.0, "batched_bf16": 0.9, "batched_fp32": 0.7}, "torch_bf16"),
    ],
)
def test_the_decision(monkeypatch, measured: dict, chosen: str) -> None:
    limits = {}

    def timed(impl, groups, device, limit):
        limits[impl.name] = limit
        return measured[impl.name], len(groups)

    monkeypatch.setattr(ns, "step_seconds", timed)
    assert ns.choose("auto", SHAPES, CPU).name == chosen
    assert limits["torch_bf16"] == ns.BUDGET_S
    assert limits["batched_bf16"] == pytest.approx(1.0 / ns.MARGIN)  # stopped once it cannot win
    assert limits["batched_fp32"] == pytest.approx(min(1.0 / ns.MARGIN, measured["batched_bf16"]))


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
    assert (kept.name, kept.resumed, kept.seconds) == ("batched_fp32", True, {})
    assert kept.kwargs == {"matmul_dtype": torch.float32}
    assert "resumed run's choice" in kept.describe()
    # a choice auto could not make now (only torch's Muon runs Polar Express) is not kept
    assert ns.choose("auto", SHAPES, CPU, "polar_express", resumed="batched_bf16").name == (
        "torch_bf16"
    )
