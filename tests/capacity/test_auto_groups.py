"""`wholeshard.planning.auto`: the automatic shard-group size, from shapes alone.

Issue 20's targets over the presets at dp 8-1024 (checked against `plan_exactly` itself, and
every larger candidate shown to miss them), small runs left at k = dp, the planning time, a
property test on random specs: the choice divides dp, its figures are its plan's, its plan is
`plan_exactly`'s, and no larger candidate meets the targets; and the automatic strategy's
choices and figures as docs/planning.md gives them.
"""

from __future__ import annotations

import functools
import math
import re
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import make_model, spec_lists

from wholeshard.capacity.choice import (
    ShardGroupChoice,
    auto_shard_group_size,
    optimizer_state,
    plan_and_choice,
)
from wholeshard.capacity.costs import Mode, owned, plan_costs, storage_units
from wholeshard.capacity.presets import PRESETS as ALL_PRESETS
from wholeshard.capacity.presets import preset
from wholeshard.capacity.projection import project, rank_ns_flops
from wholeshard.cli.plan_text import size
from wholeshard.planning import ParamSpec, Plan, plan_exactly, plan_for
from wholeshard.planning.auto import ladder
from wholeshard.planning.routing import route_params
from wholeshard.planning.specs import round_up
from wholeshard.planning.targets import (
    MAX_IMBALANCE,
    MIN_BUCKET_LIMIT,
    bucket_limit_at,
    bucket_size_for,
    bucket_target,
    largest_layer,
)

PRESETS = ("llama3-8b", "llama3-70b", "qwen3-30b-a3b", "moe-256x")
DPS = (8, 64, 256, 1024)


@functools.cache
def specs_of(name: str) -> tuple[ParamSpec, ...]:
    return tuple(preset(name))


@functools.cache
def choice_of(name: str, dp: int) -> tuple[ShardGroupChoice, float]:
    """The choice and the CPU seconds it took (CPU, not wall: other processes share the box)."""
    start = time.process_time()
    choice = auto_shard_group_size(specs_of(name), dp)
    return choice, time.process_time() - start


def largest_bucket(plan: Plan, specs: tuple[ParamSpec, ...]) -> int:
    """The largest storage unit: the buckets a stacked param runs across count as one."""
    return max((u.numel for u in storage_units(plan, specs)), default=0)


def limit_of(plan: Plan, target: int) -> int:
    """The bucket limit of `plan`: `target`, or its element-wise bucket of a wider param (an
    exchange plan keeps such a param alone in a bucket of the one buffer)."""
    kinds = ("adamw", "exchange")
    return bucket_limit_at(target, next((b for b in plan.buffers if b.kind in kinds), None))


def meets(plan: Plan, specs: tuple[ParamSpec, ...], target: int, padding_limit: float) -> bool:
    """Issue 20's targets, computed here from the plan alone."""
    return (
        largest_bucket(plan, specs) <= limit_of(plan, target)
        and plan.padding_fraction <= padding_limit
        and plan.ns_cost_imbalance <= MAX_IMBALANCE
    )


def assert_figures_are_the_plans(choice: ShardGroupChoice, specs: tuple[ParamSpec, ...]) -> None:
    """The choice's plan is `plan_exactly`'s at its k and bucket size, and every figure is it."""
    plan = plan_exactly(
        specs,
        choice.dp_size,
        bucket_size=choice.bucket_size,
        shard_group_size=choice.k,
        strategy=choice.plan.strategy,
    )
    assert choice.plan == plan
    assert choice.dp_size % choice.k == 0 and choice.replicas == choice.dp_size // choice.k
    assert choice.buckets == sum(len(b.buckets) for b in plan.buffers)
    assert choice.largest_bucket == largest_bucket(plan, specs)
    assert choice.padding_fraction == plan.padding_fraction
    assert choice.ns_imbalance == plan.ns_cost_imbalance
    assert choice.ns_flops == max(rank_ns_flops(plan))
    assert choice.optimizer_state == max(o.matrix + 2 * o.adamw for o in owned(plan))
    assert choice.bucket_limit == limit_of(plan, choice.bucket_target)
    assert choice.meets_targets == meets(plan, specs, choice.bucket_target, choice.padding_limit)


# ---------------------------------------------------------------- presets: issue 20's targets


@pytest.mark.parametrize(
    ("name", "dp"),
    [
        pytest.param(n, d, marks=[pytest.mark.slow] * (n == "moe-256x" and d < 1024))
        for n in PRESETS
        for d in DPS
    ],
)  # moe-256x: 2-3 s a plan; its dp 1024 stays fast
def test_presets_meet_the_targets(name: str, dp: int) -> None:
    specs = specs_of(name)
    choice, _ = choice_of(name, dp)
    assert choice.meets_targets, choice.reason
    assert choice.padding_fraction <= 0.01 and choice.ns_imbalance <= 1.10
    numel = sum(s.numel for s in specs)
    assert choice.bucket_size == bucket_size_for(numel, choice.k, choice.plan.strategy)
    target = max(MIN_BUCKET_LIMIT, 2 * largest_layer(specs))
    assert choice.bucket_target == target
    if name == "llama3-8b":
        # The documented compromise: the head and the embedding (128256 x 4096 = 525M
        # elements each, AdamW-routed) exceed 2 x a layer (2 x 218M), and the element-wise
        # planner keeps a param inside one bucket, so every k has a bucket of >= 525M. The
        # limit is raised to that bucket, and the chosen plan's largest bucket is it: the
        # whole-tensor buckets (k x the 58.7M MLP matrices) stay within it.
        head = next(b for b in choice.plan.buffers if b.kind in ("adamw", "exchange"))
        wide = {p.bucket for p in head.placements if p.numel > target}
        assert choice.bucket_limit == max(head.buckets[i].numel for i in wide) > target
        assert choice.largest_bucket == choice.bucket_limit
    else:
        assert choice.bucket_limit == target
    assert_figures_are_the_plans(choice, specs)


@pytest.mark.parametrize("dp", DPS)
@pytest.mark.parametrize("name", PRESETS)
def test_no_larger_candidate_meets_the_targets(name: str, dp: int) -> None:
    """Every ladder candidate above the choice misses a target, by `plan_exactly` itself. For
    moe-256x, whose plans take a second each, only k = 64 at dp 64 is planned again here; above
    it, a whole-tensor bucket of k x its widest matrix over the limit rules k out by arithmetic,
    and the rest the choice planned and passed over."""
    specs = specs_of(name)
    choice, _ = choice_of(name, dp)
    numel = sum(s.numel for s in specs)
    widest = max(round_up(s.numel, 64) for s in specs if s.matrix and len(s.shape) == 2)
    for k in ladder(dp):
        if k <= choice.k:
            break
        for strategy in ("balanced", "owners"):
            if strategy == "balanced" and name == "moe-256x" and (dp, k) != (64, 64):
                assert k * widest > choice.bucket_limit or k in choice.tried[:-1], k
                continue
            size = bucket_size_for(numel, k, strategy)
            plan = plan_exactly(specs, dp, bucket_size=size, shard_group_size=k, strategy=strategy)
            assert not meets(plan, specs, choice.bucket_target, choice.padding_limit), (name, dp, k)


def test_planning_is_fast_at_dp_1024() -> None:
    """Issue 20: under 2 s at dp 1024 (measured: 1.7 s CPU for moe-256x on a 2-core EPYC, the
    rest under 0.2 s). Asserted with slack for slower machines; the structural part is exact:
    the bounds leave at most 3 candidates to plan."""
    for name in PRESETS:
        choice, seconds = choice_of(name, 1024)
        assert len(choice.tried) <= 3, (name, choice.tried)
        assert seconds < 4.0, (name, seconds)


# ---------------------------------------------------------------- small runs


def tiny_specs(**kw: object) -> tuple[ParamSpec, ...]:
    """The specs `DataParallel` plans for the tests' small transformer."""
    return tuple(
        ParamSpec(r.name, r.shape, r.matrix, r.tied) for r in route_params(make_model(**kw))
    )


@pytest.mark.parametrize(
    "specs",
    [specs_of("gpt2-small"), tiny_specs(), tiny_specs(tied=True), tiny_specs(layers=4)],
    ids=["gpt2-small", "tiny", "tiny-tied", "tiny-4-layers"],
)
def test_small_runs_keep_k_equal_dp_where_it_meets_the_targets(specs: tuple) -> None:
    kept = []
    for dp in range(2, 9):
        choice = auto_shard_group_size(specs, dp)
        full, why = plan_and_choice(specs, dp)  # the automatic strategy at k = dp
        if why is not None and why.meets_targets:
            assert choice.k == dp and choice.plan == full, (dp, choice.reason)
            kept.append(dp)
        else:
            assert choice.k < dp
    assert 2 in kept  # not vacuous: a pair of ranks keeps every model unchanged
    if specs == specs_of("gpt2-small"):
        assert {2, 4, 8} <= set(kept)


def test_layers_and_ladder() -> None:
    specs = specs_of("llama3-8b")
    d, kv, ffn = 4096, 1024, 14336
    assert largest_layer(specs) == 2 * d * d + 2 * kv * d + 3 * ffn * d + 2 * d
    assert bucket_target(specs) == 2 * largest_layer(specs)
    moe = specs_of("moe-256x")
    layer = [s for s in moe if s.name.startswith("model.layers.60.")]
    assert largest_layer(moe) == sum(s.numel for s in layer)  # experts included
    assert largest_layer([ParamSpec("w", (10, 10), True)]) == 100  # no layers: largest param
    assert bucket_target([ParamSpec("w", (10, 10), True)]) == MIN_BUCKET_LIMIT
    assert ladder(1024) == [2**i for i in range(10, -1, -1)]
    assert ladder(12) == [12, 6, 4, 2, 1]
    assert ladder(7) == [7, 1]
    assert ladder(1) == [1]
    for dp in range(1, 300):
        steps = ladder(dp)
        assert all(dp % k == 0 for k in steps) and steps == sorted(set(steps), reverse=True)
        assert steps[0] == dp and steps[-1] == 1
        assert len(steps) <= math.floor(math.log2(dp)) + 2
        assert all(k in steps for k in (2**i for i in range(11)) if dp % k == 0)


def test_bad_input_is_refused() -> None:
    specs = [ParamSpec("w", (8, 8), True)]
    for kw, message in [
        ({"dp_size": 0}, "dp_size"),
        ({"dp_size": 2, "bucket_size": 0}, "bucket_size"),
        ({"dp_size": 2, "bucket_limit": 0}, "bucket_limit"),
        ({"dp_size": 2, "strategy": "nope"}, "strategy"),
    ]:
        with pytest.raises(ValueError, match=message):
            auto_shard_group_size(specs, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="duplicate"):
        auto_shard_group_size(specs * 2, 2)


def test_no_params_and_one_rank() -> None:
    choice = auto_shard_group_size([], 8)
    assert choice.k == 8 and choice.meets_targets and choice.plan.buffers == ()
    choice = auto_shard_group_size([ParamSpec("w", (8, 8), True)], 1)
    assert choice.k == 1 and choice.meets_targets and choice.tried == (1,)


# ---------------------------------------------------------------- property-based


@pytest.mark.core
@settings(max_examples=80, deadline=None)
@given(
    specs=spec_lists(max_params=40, tied_one_in=16),
    dp=st.integers(1, 48),
    bucket_size=st.one_of(st.none(), st.integers(1, 200_000)),
    bucket_limit=st.one_of(st.none(), st.integers(1, 2_000_000)),
    strategy=st.sampled_from(["balanced", "size_match", "owners"]),
)
def test_choice_is_a_divisor_with_its_plans_figures(
    specs: list[ParamSpec],
    dp: int,
    bucket_size: int | None,
    bucket_limit: int | None,
    strategy: str,
) -> None:
    specs_t = tuple(specs)
    limits = dict(bucket_size=bucket_size, bucket_limit=bucket_limit)
    choice = auto_shard_group_size(specs_t, dp, strategy=strategy, **limits)  # type: ignore[arg-type]
    assert dp % choice.k == 0 and choice.k in ladder(dp)
    numel = sum(s.numel for s in specs)

    def plan_at(k: int) -> Plan:
        size = bucket_size_for(numel, k, strategy) if bucket_size is None else bucket_size
        return plan_exactly(specs_t, dp, bucket_size=size, strategy=strategy, shard_group_size=k)  # type: ignore[arg-type]

    plan = plan_at(choice.k)
    assert choice.plan == plan and choice.bucket_size == plan.bucket_size
    assert choice.largest_bucket == largest_bucket(plan, specs)
    assert choice.padding_fraction == plan.padding_fraction
    assert choice.buckets == sum(len(b.buckets) for b in plan.buffers)
    assert choice.ns_imbalance == plan.ns_cost_imbalance
    assert choice.optimizer_state == optimizer_state(plan)
    assert choice.bucket_target == (bucket_target(specs) if bucket_limit is None else bucket_limit)
    assert choice.bucket_limit == limit_of(plan, choice.bucket_target) >= choice.bucket_target
    assert choice.meets_targets == meets(plan, specs, choice.bucket_target, choice.padding_limit)
    # The largest k: every larger candidate misses (the bounds that skip some are sound).
    larger = [k for k in ladder(dp) if k > choice.k]
    plans = {k: plan_at(k) for k in [*larger, *choice.tried]}
    for k in larger:
        assert not meets(plans[k], specs, choice.bucket_target, choice.padding_limit), k
    if not choice.meets_targets:  # the compromise: the least overshoot of the planned ones

        def overshoot(p: Plan) -> float:
            memory = (1 - choice.padding_limit) / (1 - p.padding_fraction)
            imbalance = p.ns_cost_imbalance / MAX_IMBALANCE
            return max(
                largest_bucket(p, specs) / limit_of(p, choice.bucket_target), memory, imbalance
            )

        assert all(overshoot(plan) <= overshoot(plans[k]) for k in choice.tried)


PLANNING_MD = Path(__file__).resolve().parents[2] / "docs" / "planning.md"


def documented_table(marker: str) -> list[list[str]]:
    """The cells of the table under `<!-- {marker}: checked by ... -->` in docs/planning.md."""
    text = PLANNING_MD.read_text()
    assert f"<!-- {marker}: checked by tests/capacity/test_auto_groups.py -->" in text, marker
    block = text.split(f"<!-- {marker}:")[1].split("\n\n")[0]
    rows = [line for line in block.splitlines() if line.startswith("| ")][1:]  # below the head
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_documented_automatic_strategies_are_the_planners() -> None:
    """docs/planning.md says which strategy `auto` takes for each preset at k = dp from 2 to 64
    ranks (llama3-70b's owner buckets from dp 8, not "past a few dozen ranks"): the planner's."""
    rows = documented_table("auto strategies")
    assert sorted(r[0] for r in rows) == sorted(ALL_PRESETS)
    for name, *strategies in rows:
        specs = preset(name)
        got = [plan_for(specs, dp).strategy for dp in (2, 4, 8, 16, 32, 64)]
        assert got == strategies, name
    pages = [PLANNING_MD, *PLANNING_MD.parent.glob("*.md"), PLANNING_MD.parents[1] / "README.md"]
    for page in pages:  # the claim the table replaced
        assert "few dozen ranks" not in re.sub(r"\s+", " ", page.read_text()), page


def test_documented_figures_of_the_automatic_strategy_are_the_plans() -> None:
    """The figures docs/planning.md gives for choosing owner buckets at dp 8 (bf16 params, fp32
    grads, `nvlink4-ndr400`) are those of the plans `auto` weighs, and of the exchange."""
    rows = documented_table("auto figures")
    assert {(r[0], r[1]) for r in rows} == {
        (p, s) for p in ("llama3-70b", "qwen2.5-7b") for s in ("balanced", "owners", "exchange")
    }
    for name, strategy, *cells in rows:
        specs = preset(name)
        used = sum(s.numel for s in specs)
        plan = plan_exactly(specs, 8, bucket_size=bucket_size_for(used, 8, strategy),
                            strategy=strategy)  # fmt: skip
        assert plan_for(specs, 8).strategy == "owners"  # the exchange from 64 ranks
        zero = plan_costs(plan, specs, Mode(param_dtype="bfloat16"))
        sharded = plan_costs(plan, specs, Mode(param_dtype="bfloat16", reshard_after_forward=True))
        comm = project(zero, "nvlink4-ndr400", "h100").comm_s
        assert cells == [
            f"{largest_bucket(plan, specs) / 1e6:,.0f}M",
            f"{len(zero.collectives):,}",
            size(zero.bytes_sent),
            f"{comm:.3f} s",
            size(zero.persistent[zero.worst_rank]["total"]),
            size(sharded.peak_transient),
        ], (name, strategy)
