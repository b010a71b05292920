"""The planner's cost as a property of the matrix rule: a `MatrixCost` (`SOAP.matrix_cost`,
Newton-Schulz by default) threaded from `DataParallelConfig.matrix_cost` to the balanced planner,
`rank_costs` and the automatic shard-group choice."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from support import data_parallel, make_model

import wholeshard
from wholeshard import DataParallelConfig
from wholeshard.capacity.choice import auto_shard_group_size
from wholeshard.cli.flags import field_kind
from wholeshard.engine.config import ConfigError
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


def test_config_takes_a_cost_function_and_no_flag() -> None:
    field = {f.name: f for f in dataclasses.fields(DataParallelConfig)}["matrix_cost"]
    assert field_kind(DataParallelConfig, field) is None
    assert "matrix_cost" not in jobfile.keys()["parallel"]
    with pytest.raises(ConfigError, match="matrix_cost"):
        DataParallelConfig(matrix_cost=3)
    ddp = wholeshard.DataParallel(make_model(), matrix_cost=SOAP.matrix_cost)
    assert ddp.plan.matrix_cost is SOAP.matrix_cost
    assert wholeshard.DataParallel(make_model()).plan.matrix_cost is None


def make_ddp(**kw) -> wholeshard.DataParallel:
    return data_parallel(make_model(), **kw)


def test_layerwise_warns_when_planned_for_another_rule() -> None:
    with pytest.warns(UserWarning, match=r"matrix_cost=SOAP\.matrix_cost"):
        wholeshard.LayerwiseOptimizer(make_ddp(), matrix_optimizer=SOAP)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wholeshard.LayerwiseOptimizer(make_ddp(matrix_cost=SOAP.matrix_cost), matrix_optimizer=SOAP)
        wholeshard.LayerwiseOptimizer(make_ddp(), matrix_optimizer=NorMuon)
        wholeshard.LayerwiseOptimizer(make_ddp())  # torch's Muon: no matrix_cost, Newton-Schulz
