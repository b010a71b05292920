"""`wholeshard plan --node-size` and the group structure beside the strategies ([Note: group
structure figures] in `capacity.strategy_choice`): which structure is projected faster, the
runner-up, the figures that decided it and the option to pass; clear errors with exit 2."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_plan_command import run

from wholeshard.capacity.costs import Mode, plan_costs
from wholeshard.capacity.presets import preset
from wholeshard.capacity.projection import FABRICS
from wholeshard.capacity.strategy_choice import figures
from wholeshard.planning import plan_for
from wholeshard.planning.plan import two_level

LLAMA_1024 = ["--preset", "llama3-8b", "--dp", "1024", "--fabric", "nvlink4-ndr400"]


def plan_doc(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = run([*argv, "--json"], capsys)
    assert code == 0 and err == ""
    return json.loads(out)


def flat(text: str, label: str, until: str) -> str:
    """The words of one labelled line of the table, on one line."""
    return " ".join(text.split(f"\n{label}")[1].split(f"\n{until}")[0].split())


def test_two_levels_projected_faster_say_the_option_and_the_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """llama3-8b at dp 1024 (exchange): two levels of 8 cut the latency term more than the
    node stage adds bandwidth; the structure's figures are those of the same plan in each
    structure, and the plan made with the option has the figures it promised."""
    doc = plan_doc(LLAMA_1024, capsys)
    assert doc["node_size"] == 1 and doc["strategy"] == "exchange"
    choice = doc["strategy_choice"]
    shape = choice["group_structure"]
    assert (shape["strategy"], shape["planned"], shape["chosen"], shape["runner_up"]) == (
        "exchange", 1, 8, 1,
    )  # fmt: skip
    assert shape["option"] == "node_size=8, --node-size 8"
    one, two = shape["figures"]["exchange"]["1"], shape["figures"]["exchange"]["8"]
    assert one == choice["figures"]["exchange"]  # the plan as planned
    assert two["step_s"] < one["step_s"] and two["latency_s"] < one["latency_s"] / 3
    assert two["bandwidth_s"] > one["bandwidth_s"]  # 8 NICs: the flat ring uses them all
    assert two["newton_schulz_s"] == one["newton_schulz_s"]  # same plan, same owners
    specs = preset("llama3-8b")
    plan = two_level(plan_for(specs, 1024), 8)
    mode = Mode(param_dtype="bfloat16")
    expected = figures(plan_costs(plan, specs, mode), FABRICS["nvlink4-ndr400"], "h100")
    assert two == pytest.approx(expected.as_dict())
    assert set(shape["figures"]["balanced"]) == {"1", "8"}
    _, out, _ = run(LLAMA_1024, capsys)
    line = flat(out, "group structure", "shard groups")
    assert line.startswith("two levels of 8 ") and "projected faster: pass node_size=8, " in line
    assert "--node-size 8; runner-up one level " in line
    # planned in two levels, the plan is what the structure projected
    two_doc = plan_doc([*LLAMA_1024, "--node-size", "8"], capsys)
    assert two_doc["node_size"] == 8
    assert two_doc["strategy_choice"]["figures"]["exchange"] == pytest.approx(two)
    assert two_doc["strategy_choice"]["group_structure"]["option"] is None
    assert two_doc["strategy_choice"]["unplanned"]["owners"].startswith("node_size=8: ")
    _, out, _ = run([*LLAMA_1024, "--node-size", "8"], capsys)
    assert "of 1024 ranks; two levels: nodes of 8 (each bucket reduce-scattered within the " in (
        flat(out, "shard groups", "buckets")
    )
    assert "(as planned); runner-up one level" in flat(out, "group structure", "shard groups")


def test_one_level_projected_faster_says_to_leave_node_size_unset(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """llama3-70b at dp 256 on 8 NICs a node: bandwidth decides, and the node stage's NVLink
    time costs more than the latency it saves."""
    argv = ["--preset", "llama3-70b", "--dp", "256", "--node-size", "8"]
    shape = plan_doc(argv, capsys)["strategy_choice"]["group_structure"]
    assert (shape["planned"], shape["chosen"], shape["runner_up"]) == (8, 1, 8)
    assert shape["option"] == "leave node_size unset (no --node-size)"
    mine = shape["figures"][shape["strategy"]]
    assert mine["1"]["step_s"] < mine["8"]["step_s"]
    _, out, _ = run(argv, capsys)
    line = flat(out, "group structure", "shard groups")
    assert line.startswith("one level ") and "), projected faster: leave node_size unset (no " in (
        line
    )


def test_where_two_levels_do_not_apply_the_structure_says_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    small = plan_doc(["--preset", "llama3-8b", "--dp", "8"], capsys)["strategy_choice"]
    shape = small["group_structure"]
    assert (shape["chosen"], shape["runner_up"], shape["option"]) == (1, None, None)
    assert shape["not_two_level"][shape["strategy"]] == (
        "a shard group of 8 fits in a node of 8 GPUs"
    )
    owners = plan_doc(["--preset", "llama3-8b", "--dp", "64", "--strategy", "owners"], capsys)
    shape = owners["strategy_choice"]["group_structure"]
    assert shape["strategy"] == "owners" and set(shape["figures"]["owners"]) == {"1"}
    assert "syncs buckets by 'owners'" in shape["not_two_level"]["owners"]
    assert set(shape["figures"]["exchange"]) == {"1", "8"}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--node-size", "6"], "node_size=6 does not divide the shard group size 64"),
        (
            ["--node-size", "8", "--strategy", "owners"],
            "syncs buckets by 'owners'; pass strategy='exchange'",
        ),
        (["--node-size", "8", "--shard-group-size", "12"], "shard_group_size must be an int"),
    ],
)
def test_a_node_size_that_does_not_fit_exits_2_with_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["--preset", "llama3-8b", "--dp", "64", *argv], capsys)
    assert code == 2 and out == ""
    assert err.startswith("wholeshard plan: error: ") and says in err
    assert len(err.strip().splitlines()) == 1
