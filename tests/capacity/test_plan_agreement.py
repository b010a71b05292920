"""`wholeshard plan` and `DataParallel` make the same plan for the same inputs: the capacity
package's planning call (`capacity.choice.plan_and_choice`, what the CLI calls) returns the plan
of `planning.auto.plan_for` (what `DataParallel.__init__` calls), and its report measures that
plan with the cost the planner balanced."""

from __future__ import annotations

import argparse
import json

import pytest

import wholeshard.engine._sharded_group as engine_group
from wholeshard.capacity.choice import plan_and_choice
from wholeshard.capacity.presets import PRESETS
from wholeshard.cli import plan as plan_tool
from wholeshard.planning.auto import plan_for

SETTINGS = [
    {},
    {"shard_group_size": "auto"},
    {"strategy": "owners", "shard_group_size": "auto"},
    {"strategy": "balanced"},
]


def test_data_parallel_plans_with_the_decision() -> None:
    assert engine_group.plan_for is plan_for


@pytest.mark.parametrize("dp", [8, 64])
@pytest.mark.parametrize("name", sorted(set(PRESETS) - {"moe-256x"}))
def test_the_cli_and_data_parallel_make_the_same_plan(name: str, dp: int) -> None:
    specs = PRESETS[name]()
    for kw in SETTINGS:
        plan, choice = plan_and_choice(specs, dp, **kw)  # type: ignore[arg-type]
        assert plan == plan_for(specs, dp, **kw), (name, dp, kw)  # type: ignore[arg-type]
        if choice is not None:
            assert choice.plan == plan
            assert choice.ns_imbalance == plan.ns_cost_imbalance  # one cost model


def test_the_command_shows_the_decisions_plan(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="wholeshard")
    plan_tool.add_parser(parser.add_subparsers(dest="command", required=True))
    argv = ["plan", "--preset", "llama3-8b", "--dp", "64", "--shard-group-size", "auto", "--json"]
    args = parser.parse_args(argv)
    assert args.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    plan = plan_for(PRESETS["llama3-8b"](), 64, shard_group_size="auto")
    assert doc["shard_group_size"] == plan.shard_group_size and doc["strategy"] == plan.strategy
    assert [b["numel"] for b in doc["buffers"]] == [b.numel for b in plan.buffers]
    assert doc["ns_cost_imbalance"] == doc["shard_group_choice"]["ns_imbalance"]
