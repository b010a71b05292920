"""`wholeshard.capacity.bucket_hint` ([Note: the bucket-size hint]) and its place in
`wholeshard plan --fabric`: where latency is a large share of communication, a `--bucket-size`
whose plan, made again, has latency at most 10% of it (or the bucket limit, saying it misses),
with that plan's own figures; none where latency is small."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from wholeshard.capacity.bucket_hint import (
    HEADROOM,
    HINT_SHARE,
    TARGET_SHARE,
    BucketSizeHint,
    bucket_size_hint,
    next_size,
    round_up,
)
from wholeshard.capacity.costs import Mode, plan_costs, sharded_peak
from wholeshard.capacity.presets import preset
from wholeshard.capacity.projection import Projection, project
from wholeshard.cli import plan as plan_tool
from wholeshard.planning import ParamSpec, plan_for
from wholeshard.planning.plan import Strategy
from wholeshard.planning.targets import bucket_target, largest_unit

FABRIC = "nvlink4-ndr400"
MODE = Mode(param_dtype="bfloat16")  # the plan command's default dtypes
REPO = Path(__file__).resolve().parents[2]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser(prog="wholeshard")
    plan_tool.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    assert args.run(args) == 0
    return capsys.readouterr().out


def projected_at(
    specs: Sequence[ParamSpec], dp: int, size: int | None, strategy: Strategy = "auto"
) -> Projection:
    plan = plan_for(specs, dp, bucket_size=size, strategy=strategy)
    return project(plan_costs(plan, specs, MODE), FABRIC, "h100")


def assert_replans_to(hint: BucketSizeHint, specs: Sequence[ParamSpec], dp: int) -> Projection:
    """Planning again at the hinted size gives every figure the hint reports."""
    plan = plan_for(specs, dp, bucket_size=hint.bucket_size)
    again = project(plan_costs(plan, specs, MODE), FABRIC, "h100")
    assert again == hint.projection and largest_unit(plan) == hint.largest_bucket
    assert sharded_peak(plan, specs, MODE) == hint.peak_transient_bytes
    return again


@pytest.mark.slow  # 10 s of planning; the hint's rule is tested on the smaller presets above
def test_moe_256x_at_dp_1024_is_told_a_size_that_brings_latency_under_a_tenth(
    capsys: pytest.CaptureFixture[str],
) -> None:
    specs = preset("moe-256x")
    # owner buckets (the automatic choice before the exchange, whose latency needs no hint)
    doc = json.loads(run(["--preset", "moe-256x", "--dp", "1024", "--fabric", FABRIC,
                          "--strategy", "owners", "--json"], capsys))  # fmt: skip
    p = doc["projection"]
    assert p["latency_s"] > HINT_SHARE * p["comm_s"]  # 129 s of 140 s
    hint = doc["projection"]["bucket_size_hint"]
    assert hint["meets_target"] and hint["bucket_size"] > doc["bucket_size"]
    assert hint["bucket_size"] <= hint["bucket_limit"] == bucket_target(specs)
    again = projected_at(specs, 1024, hint["bucket_size"], "owners")
    assert again.latency_s <= TARGET_SHARE * again.comm_s
    assert again.latency_s == hint["latency_s"] and again.comm_s == hint["comm_s"]
    assert hint["collectives"] == again.collectives < p["collectives"]
    assert hint["peak_transient_bytes"] > 0 and hint["largest_bucket"] > 0
    docs = " ".join((REPO / "docs" / "planning.md").read_text().split())
    quoted = (
        f"`--bucket-size {hint['bucket_size']:,}` gives latency {hint['latency_s']:.3g} s + "
        f"bandwidth {hint['bandwidth_s']:.3g} s ({hint['collectives']:,} collectives, "
        f"{hint['latency_share']:.1%} of communication, against {p['latency_s']:.3g} s"
    )
    assert quoted in docs, "docs/planning.md's bucket-size hint: update its figures"
    assert f"at {hint['peak_transient_bytes'] / 2**30:.2f} GiB, not" in docs
    assert f"its largest bucket is {hint['largest_bucket']:,} elements" in docs


def test_where_no_size_within_the_bucket_limit_suffices_the_hint_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """llama3-8b at dp 1024: 102 collectives are left at the bucket limit (two layers), still
    over a tenth of communication; the hint names the limit and what it gives."""
    specs = preset("llama3-8b")
    plan = plan_for(specs, 1024)
    costs = plan_costs(plan, specs, MODE)
    projected = project(costs, FABRIC, "h100")
    hint = bucket_size_hint(costs, projected, specs)
    assert hint is not None and not hint.meets_target
    assert hint.bucket_size == hint.bucket_limit == bucket_target(specs)
    again = assert_replans_to(hint, specs, 1024)
    assert TARGET_SHARE * again.comm_s < again.latency_s < projected.latency_s
    assert hint.from_bucket_size == plan.bucket_size
    assert hint.from_peak_transient_bytes == sharded_peak(plan, specs, MODE)
    out = run(["--preset", "llama3-8b", "--dp", "1024", "--fabric", FABRIC], capsys)
    lead = out.split("\n\n")[1]
    assert f"{'latency':<19}{hint.describe(projected)[:40]}" in lead
    text = " ".join(lead.split())
    assert " ".join(hint.describe(projected).split()) in text
    assert f"no --bucket-size up to the planner's bucket limit ({hint.bucket_limit:,})" in text
    doc = json.loads(run(["--preset", "llama3-8b", "--dp", "1024", "--fabric", FABRIC,
                          "--json"], capsys))  # fmt: skip
    assert doc["projection"]["bucket_size_hint"] == hint.as_dict()


def test_a_small_latency_term_gets_no_hint(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--preset", "llama3-8b", "--dp", "8", "--fabric", FABRIC]
    doc = json.loads(run([*argv, "--json"], capsys))
    p = doc["projection"]
    assert p["latency_s"] <= HINT_SHARE * p["comm_s"] and p["bucket_size_hint"] is None
    assert "\nlatency " not in run(argv, capsys)
    assert "bucket_size_hint" not in json.loads(run(argv[:4] + ["--json"], capsys))


def test_the_hint_keeps_the_plans_other_settings() -> None:
    """Shard groups of 512 at dp 1024: the hint plans again with them (as `--bucket-size` with
    the same flags would), not with one group of dp."""
    specs = preset("llama3-8b")
    plan = plan_for(specs, 1024, shard_group_size=512)
    costs = plan_costs(plan, specs, MODE)
    projected = project(costs, FABRIC, "h100")
    hint = bucket_size_hint(costs, projected, specs, shard_group_size=512)
    assert hint is not None
    for k, same in ((512, True), (1024, False)):
        again = plan_for(specs, 1024, bucket_size=hint.bucket_size, shard_group_size=k)
        figures = project(plan_costs(again, specs, MODE), FABRIC, "h100")
        assert (figures == hint.projection) is same


def test_sizes_round_up_to_two_significant_digits() -> None:
    assert [round_up(n) for n in (576_320_000, 580_000_000, 7, 10.5, 99_001)] == [
        580_000_000, 580_000_000, 7, 11, 100_000,
    ]  # fmt: skip


def test_the_next_size_scales_then_fits_latency_a_plus_b_over_size() -> None:
    """Bandwidth 90 s: the target latency is 10 s. From one plan, latency over it times the
    size; from two on `a + b / size` (a = 5, b = 4e9), where that is 10 s: 8e8; each 20%
    over and rounded up; the limit where the fit never reaches the target or for the last."""

    def at(latency: float) -> Projection:
        return Projection(FABRIC, "h100", latency, 90.0, 0.0, 0.0, 0, 0)

    one = [(40_000_000, None, at(105.0))]
    assert next_size(one, 10**12, last=False) == round_up(40e6 * 10.5 * HEADROOM) == 510_000_000
    two = [*one, (400_000_000, None, at(15.0))]  # 5 + 4e9 / 4e8
    assert next_size(two, 10**12, last=False) == round_up(8e8 * HEADROOM) == 960_000_000
    assert next_size(two, 900_000_000, last=False) == 900_000_000  # held to the limit
    assert next_size(two, 400_000_000, last=False) is None  # at the limit already
    assert next_size(two, 10**12, last=True) == 10**12
    floor = [*one, (400_000_000, None, at(100.0))]  # a = 99.4 > 10: no size meets it
    assert next_size(floor, 2 * 10**9, last=False) == 2 * 10**9


def test_the_sharded_peak_is_the_costs_own() -> None:
    specs = preset("llama3-8b")
    plan = plan_for(specs, 16)
    resharded = plan_costs(plan, specs, Mode(param_dtype="bfloat16", reshard_after_forward=True))
    assert sharded_peak(plan, specs, MODE) == resharded.peak_transient > 0
    assert sharded_peak(plan_for(specs, 16, shard_group_size=1), specs, MODE) == 0
    mode = Mode(param_dtype="bfloat16", reshard_after_forward=True)  # the hint reuses it
    costs = plan_costs(plan_for(specs, 1024), specs, mode)
    hint = bucket_size_hint(costs, project(costs, FABRIC, "h100"), specs)
    assert hint is not None and hint.from_peak_transient_bytes == costs.peak_transient > 0
