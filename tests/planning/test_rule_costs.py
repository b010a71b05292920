"""The planner's cost as a property of the matrix rule: a `MatrixCost` (`SOAP.matrix_cost`,
Newton-Schulz by default) taken from the rule `LayerwiseOptimizer` is given
(`DataParallel.balance_for`) to the balanced planner, `rank_costs` and the automatic shard-group
choice."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import run
from torch import nn

import wholeshard
from wholeshard import DataParallelConfig
from wholeshard.capacity.choice import auto_shard_group_size
from wholeshard.optim import SOAP, NorMuon
from wholeshard.planning import ONE_BUCKET, ParamSpec, plan_exactly
from wholeshard.planning.auto import MAX_IMBALANCE, plan_for
from wholeshard.planning.specs import cost_imbalance, newton_schulz_cost, ns_cost, shape_cost
from wholeshard.train import jobfile

SHAPES = [(64, 64), (256, 16), (32, 128), (16, 256), (96, 48)]
"""Matrices whose two costs disagree: Newton-Schulz (max x min²) finds the square one the
costliest, SOAP (rotations, m n (m + n), and eigenbasis refreshes, m³ + n³) the thin ones."""


def mixed(layers: int) -> list[ParamSpec]:
    return [
        ParamSpec(f"layers.{i}.w{j}", shape, True)
        for i in range(layers)
        for j, shape in enumerate(SHAPES)
    ]


def soap_imbalance(plan) -> float:
    return cost_imbalance(
        [sum(c) for c in zip(*(b.rank_costs(SOAP.matrix_cost) for b in plan.buffers), strict=True)]
    )


@pytest.mark.parametrize("dp, layers", [(4, 6), (8, 4)])
def test_balanced_plan_balances_the_rules_cost(dp: int, layers: int) -> None:
    """Measured SOAP imbalance: Newton-Schulz-balanced plan 1.190 (dp 4) and 1.569 (dp 8);
    SOAP-balanced 1.030 and 1.090, at the same padding."""
    specs = mixed(layers)
    ns = plan_exactly(specs, dp, bucket_size=ONE_BUCKET)
    soap = plan_exactly(specs, dp, matrix_cost=SOAP.matrix_cost, bucket_size=ONE_BUCKET)
    assert ns.ns_cost_imbalance <= MAX_IMBALANCE  # Newton-Schulz is balanced for Muon...
    assert soap_imbalance(ns) > MAX_IMBALANCE  # ...which leaves SOAP's work uneven
    assert soap.matrix_cost is SOAP.matrix_cost
    assert soap.ns_cost_imbalance == soap_imbalance(soap) <= MAX_IMBALANCE
    assert soap.padding_fraction <= ns.padding_fraction
    assert (
        plan_exactly(specs, dp, matrix_cost=newton_schulz_cost, bucket_size=ONE_BUCKET) == ns
    )  # the same default


def test_costs_come_from_one_place() -> None:
    assert NorMuon.matrix_cost is newton_schulz_cost
    assert newton_schulz_cost(16, 256) == ns_cost((16, 256)) == shape_cost((16, 256))
    assert shape_cost((16, 256), SOAP.matrix_cost) == SOAP.matrix_cost(16, 256)
    assert shape_cost((4, 16, 256), SOAP.matrix_cost) == 0  # a stack's matrices are costed apart


def test_auto_shard_groups_measure_the_rules_cost() -> None:
    specs = mixed(4)
    choice = auto_shard_group_size(specs, 8, matrix_cost=SOAP.matrix_cost)
    assert choice.plan.matrix_cost is SOAP.matrix_cost
    assert choice.ns_imbalance == soap_imbalance(choice.plan)
    plan = plan_for(specs, 8, shard_group_size="auto", matrix_cost=SOAP.matrix_cost)
    assert plan.matrix_cost is SOAP.matrix_cost


def mixed_model(layers: int) -> nn.Module:
    """`mixed(layers)` as a module of linear layers (only read, never run)."""
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.ModuleList(nn.Linear(n, m, bias=False) for m, n in SHAPES) for _ in range(layers)
    )


def _relaid(reshard: bool) -> dict:
    ddp = wholeshard.DataParallel(mixed_model(6), reshard_after_forward=reshard)
    with ddp.full_params():
        before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    plan = ddp.plan
    wholeshard.LayerwiseOptimizer(ddp, matrix_optimizer=NorMuon)  # Newton-Schulz: kept
    kept = ddp.plan is plan
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix_optimizer=SOAP)
    specs = [ParamSpec(r.name, r.shape, r.matrix, r.tied) for r in ddp.routes]
    planned = plan_for(specs, ddp.dp_size, matrix_cost=SOAP.matrix_cost)
    with ddp.full_params():
        same = all(torch.equal(p, before[n]) for n, p in ddp.module.named_parameters())
    with pytest.raises(RuntimeError, match="already has an optimizer"):
        ddp.balance_for(wholeshard.optim.BatchedMuon)
    del opt
    moved = plan != ddp.plan and ddp.plan.matrix_cost is SOAP.matrix_cost
    return {"kept": kept, "moved": moved, "as_planned": ddp.plan == planned, "values": same}


@pytest.mark.parametrize("reshard", [False, True], ids=["zero", "fully-sharded"])
def test_the_layout_follows_the_rule_the_optimizer_is_given(reshard: bool) -> None:
    """One source of truth: no config field or flag; the optimizer's rule lays the params out
    again (they keep their values); a rule costing Newton-Schulz keeps the plan."""
    assert "matrix_cost" not in {f.name for f in dataclasses.fields(DataParallelConfig)}
    assert "matrix_cost" not in jobfile.keys()["parallel"]
    for out in run(_relaid, 4, reshard):
        assert out == {"kept": True, "moved": True, "as_planned": True, "values": True}
