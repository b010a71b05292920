"""Tests for `wholeshard.plan`: every plan invariant is re-checked here without `Plan.check`,
element-wise ownership is checked element by element, and `Plan.check` is shown to catch
broken plans."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import round_up, spec, verify_whole_buffer

from wholeshard.engine.config import DataParallelConfig, Variant
from wholeshard.planning import (
    ONE_BUCKET,
    Bucket,
    Buffer,
    ParamSpec,
    Placement,
    Plan,
    default_bucket_size,
    plan_exactly,
    plan_for,
)
from wholeshard.planning.specs import ns_cost


def verify(plan: Plan, specs: list[ParamSpec]) -> None:
    """Re-check every plan invariant without calling `Plan.check`: whole-tensor buffers by
    `verify_whole_buffer`, element-wise ones by `verify_elementwise`."""
    k = plan.shard_group_size
    assert plan.dp_size % k == 0
    kinds = {"matrix": [s for s in specs if s.matrix], "adamw": [s for s in specs if not s.matrix]}
    assert [b.kind for b in plan.buffers] == [kind for kind in kinds if kinds[kind]]
    padded = total = 0
    for buffer in plan.buffers:
        mine = kinds[buffer.kind]
        assert (buffer.shard_group_size, buffer.align) == (k, plan.align)
        if buffer.whole:
            verify_whole_buffer(buffer, mine)
        else:
            verify_elementwise(buffer, mine)
        for p in buffer.placements:
            verify_ownership(buffer, p)
        padded += buffer.numel - sum(s.numel for s in mine)
        total += buffer.numel
    assert math.isclose(plan.padding_fraction, padded / total if total else 0.0, abs_tol=1e-12)
    costs = [0] * k
    for buffer in plan.buffers:
        for p in buffer.placements:
            if buffer.whole:
                costs[p.owner] += ns_cost(p.shape)
    expected = max(costs) / (sum(costs) / k) if sum(costs) else 1.0
    assert math.isclose(plan.ns_cost_imbalance, expected)
    assert plan.rank_costs() == costs


def verify_elementwise(buffer: Buffer, specs: list[ParamSpec]) -> None:
    """An element-wise buffer: k equal aligned shards per bucket, params packed tightly in
    backprop order, padding only for alignment."""
    k, align = buffer.shard_group_size, buffer.align
    assert [(p.name, p.shape) for p in buffer.placements] == [(s.name, s.shape) for s in specs]
    pos = 0
    for i, b in enumerate(buffer.buckets):
        assert (b.index, b.start) == (i, pos)
        assert b.numel == k * b.shard_numel and b.shard_numel % align == 0 and b.numel > 0
        pos = b.end
    assert buffer.numel == pos
    for s, p in zip(specs, buffer.placements, strict=True):
        b = buffer.buckets[p.bucket]
        assert p.end - p.start == s.numel and p.start % align == 0
        assert b.start <= p.start and p.end <= b.end and p.owner is None
    # Backprop order: every bucket holds the last-registered param not in earlier buckets.
    remaining = set(range(len(specs)))
    for i in range(len(buffer.buckets)):
        members = {j for j, p in enumerate(buffer.placements) if p.bucket == i}
        assert members and max(remaining) in members
        remaining -= members
    starts = [p.start for p in buffer.placements]
    assert starts == sorted(starts, reverse=True) and len(set(starts)) == len(starts)
    bound = len(specs) * (align - 1) + len(buffer.buckets) * (k * align - 1)
    assert buffer.numel - sum(s.numel for s in specs) <= bound


def verify_ownership(buffer: Buffer, p: Placement) -> None:
    """The owned ranges of all shard-group ranks tile the param, each being exactly the part
    of the param inside that rank's shard of its bucket."""
    b = buffer.buckets[p.bucket]
    pieces = []
    for r in range(buffer.shard_group_size):
        offset, length = buffer.owned_range(p, r)
        lo, hi = b.shard(r)
        inside = max(0, min(p.end, hi) - max(p.start, lo))
        assert length == inside
        if length:
            assert p.start + offset == max(p.start, lo)
            pieces.append((offset, length))
        else:
            assert offset == 0
    covered = 0
    for offset, length in pieces:  # ranks in order own consecutive pieces
        assert offset == covered
        covered += length
    assert covered == p.numel


# ---------------------------------------------------------------- element-wise buffers


def test_tied_embedding_adds_no_padding() -> None:
    specs = [spec("wte", 1000, 64, matrix=False, tied=True), spec("fc", 64, 64), spec("ln", 64)]
    plan = plan_exactly(specs, 8, bucket_size=ONE_BUCKET)
    verify(plan, specs)
    muon, adamw = plan.buffers
    assert adamw.kind == "adamw" and adamw.used == 64 + 64_000
    assert adamw.numel == round_up(adamw.used, 8 * 64)  # only the bucket's end is padded
    assert adamw.placements[0].name == "wte"
    assert adamw.placements[0].start == 64  # backprop order: ln first
    assert muon.numel == 8 * 4096  # one 64x64 matrix on rank 0, padding on ranks 1..7


def test_elementwise_params_straddle_shards() -> None:
    specs = [spec("emb", 10, 30, matrix=False), spec("w", 16, 16), spec("b", 100)]
    plan = plan_exactly(specs, 4, align=1, bucket_size=ONE_BUCKET)
    verify(plan, specs)
    adamw = plan.buffers[1]
    assert adamw.buckets == (Bucket(0, 0, 400, 100),)
    b, emb = adamw.placements[1], adamw.placements[0]
    assert (b.start, b.end, emb.start, emb.end) == (0, 100, 100, 400)
    assert [adamw.owned_range(emb, r) for r in range(4)] == [
        (0, 0),
        (0, 100),
        (100, 100),
        (200, 100),
    ]
    assert list(adamw.owned(0)) == [(b, 0, 100)]
    assert list(adamw.owned(3)) == [(emb, 200, 100)]


def test_elementwise_alignment_and_bucket_padding() -> None:
    specs = [spec("a", 100), spec("b", 3), spec("c", 70)]
    plan = plan_exactly(specs, 3, align=64, bucket_size=ONE_BUCKET)
    verify(plan, specs)
    (adamw,) = plan.buffers
    assert [(p.name, p.start) for p in adamw.placements] == [("a", 192), ("b", 128), ("c", 0)]
    assert adamw.buckets == (Bucket(0, 0, 384, 128),)  # 292 elements, rounded up to 3 * 64 * 2


def test_elementwise_buckets_close_at_bucket_size() -> None:
    specs = [spec(f"v{i}", 1001) for i in range(10)]
    plan = plan_exactly(specs, 2, bucket_size=2500, align=8)
    verify(plan, specs)
    (adamw,) = plan.buffers
    # 1001 -> 1008 aligned: a bucket closes with its third param (3024 >= 2500).
    assert [sum(p.bucket == i for p in adamw.placements) for i in range(4)] == [3, 3, 3, 1]
    assert [b.numel for b in adamw.buckets] == [3024, 3024, 3024, 1008]
    assert adamw.placements[-1].bucket == 0 and adamw.placements[0].bucket == 3


def test_owned_range_of_whole_tensor_buffer_and_bad_rank() -> None:
    specs = [spec("w1", 64, 64), spec("w2", 64, 64)]
    plan = plan_exactly(specs, 2, strategy="size_match", bucket_size=ONE_BUCKET)
    (muon,) = plan.buffers
    for p in muon.placements:
        assert muon.owned_range(p, p.owner) == (0, 4096)
        assert muon.owned_range(p, 1 - p.owner) == (0, 0)
    with pytest.raises(ValueError, match="shard group 0..1"):
        muon.owned_range(muon.placements[0], 2)


# ---------------------------------------------------------------- shard groups


@pytest.mark.core
def test_shard_groups_plan_over_k_ranks() -> None:
    specs = [spec(f"w{i}", 128, 128) for i in range(16)] + [spec("ln", 256)]
    plan = plan_exactly(specs, 8, shard_group_size=4, bucket_size=ONE_BUCKET)
    verify(plan, specs)
    assert plan.shard_group_size == 4 and plan.dp_size == 8
    muon = plan.buffers[0]
    assert {p.owner for p in muon.placements} == {0, 1, 2, 3}
    assert plan.padding_fraction == 0.0 and plan.ns_cost_imbalance == 1.0
    assert [plan.shard_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="not in 0..7"):
        plan.shard_rank(8)
    assert plan_exactly(specs, 8, bucket_size=ONE_BUCKET).shard_group_size == 8


@pytest.mark.parametrize("k", [3, 0, -2, 16, 2.0, True])
def test_shard_group_size_must_divide_dp(k: object) -> None:
    with pytest.raises(ValueError, match=r"must be an int dividing dp_size=8.*\[1, 2, 4, 8\]"):
        plan_exactly([spec("w", 4, 4)], 8, shard_group_size=k, bucket_size=ONE_BUCKET)  # type: ignore[arg-type]


def test_bad_inputs_are_value_errors() -> None:
    with pytest.raises(ValueError, match="strategy must be one of"):
        plan_exactly([spec("w", 4, 4)], 2, strategy="greedy", bucket_size=ONE_BUCKET)
    with pytest.raises(ValueError, match="duplicate param name 'w'"):
        plan_exactly([spec("w", 4, 4), spec("w", 4)], 2, bucket_size=ONE_BUCKET)
    with pytest.raises(ValueError, match="negative size"):
        plan_exactly([spec("b", -4)], 2, bucket_size=ONE_BUCKET)


@pytest.mark.parametrize("size", [None, 0, -1, 2.5, True, "40M"])
def test_plan_exactly_takes_no_default_bucket_size(size: object) -> None:
    """None is `plan_for`'s default size, never one bucket: `plan_exactly` refuses it."""
    with pytest.raises(ValueError, match="pass an int > 0 .* or ONE_BUCKET.*plan_for"):
        plan_exactly([spec("w", 4, 4)], 2, bucket_size=size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy='auto'.*plan_for"):
        plan_exactly([spec("w", 4, 4)], 2, bucket_size=ONE_BUCKET, strategy="auto")


def test_plan_for_makes_data_parallels_plan_with_its_defaults() -> None:
    """`plan_for`'s defaults are `DataParallel`'s: the default bucket size (not one bucket), the
    automatic strategy, one shard group."""
    cfg, variant = DataParallelConfig(), Variant()
    assert (cfg.bucket_size, variant.strategy, cfg.shard_group_size) == (None, "auto", None)
    specs = [spec(f"w{i}", 256, 256) for i in range(16)] + [spec(f"b{i}", 256) for i in range(16)]
    plan = plan_for(specs, 2)
    size = default_bucket_size(sum(s.numel for s in specs), 2)
    assert plan.bucket_size == size and plan.strategy == "balanced"
    assert plan == plan_exactly(specs, 2, bucket_size=size, strategy="balanced")
    assert plan != plan_exactly(specs, 2, bucket_size=ONE_BUCKET)


def test_only_one_kind_and_empty() -> None:
    only_muon = plan_exactly([spec("w", 8, 8)], 2, bucket_size=ONE_BUCKET)
    assert [b.kind for b in only_muon.buffers] == ["matrix"]
    empty = plan_exactly([], 4, bucket_size=ONE_BUCKET)
    assert empty.buffers == () and empty.padding_fraction == 0.0
    assert empty.ns_cost_imbalance == 1.0


def test_imbalance_counts_muon_costs_per_rank() -> None:
    # Two matrices of different cost: imbalance = max / mean over the two ranks.
    specs = [spec("big", 64, 256), spec("small", 64, 64)]
    big, small = 256 * 64**2, 64**3
    balanced = plan_exactly(specs, 2, strategy="balanced", bucket_size=ONE_BUCKET)
    verify(balanced, specs)
    assert sorted(balanced.rank_costs()) == [small, big]
    assert math.isclose(balanced.ns_cost_imbalance, big / ((big + small) / 2))
    # Size matching finds no partner for either and stacks both rows on rank 0.
    size_match = plan_exactly(specs, 2, strategy="size_match", bucket_size=ONE_BUCKET)
    verify(size_match, specs)
    assert size_match.rank_costs() == [big + small, 0] and size_match.ns_cost_imbalance == 2.0


# ---------------------------------------------------------------- property-based


@st.composite
def models(draw: st.DrawFn) -> list[ParamSpec]:
    dim = st.integers(1, 200)
    pool = draw(st.lists(st.tuples(dim, dim), min_size=1, max_size=4))
    specs = []
    for i in range(draw(st.integers(0, 40))):
        shape = draw(st.one_of(st.sampled_from(pool), st.tuples(dim, dim), st.tuples(dim)))
        muon = len(shape) == 2 and draw(st.integers(0, 5)) > 0
        tied = draw(st.integers(0, 12)) == 0
        specs.append(ParamSpec(f"p{i}", shape, matrix=muon, tied=tied))
    return specs


@pytest.mark.core
@settings(max_examples=120, deadline=None)
@given(
    specs=models(),
    dp=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]),
    data=st.data(),
    bucket_size=st.one_of(st.just(ONE_BUCKET), st.integers(1, 200_000)),
    align=st.sampled_from([1, 8, 64]),
    strategy=st.sampled_from(["size_match", "balanced"]),
)
def test_random_plans_keep_invariants(
    specs: list[ParamSpec],
    dp: int,
    data: st.DataObject,
    bucket_size: int | float,
    align: int,
    strategy: str,
) -> None:
    k = data.draw(st.sampled_from([d for d in range(1, dp + 1) if dp % d == 0]))
    plan = plan_exactly(
        specs, dp, bucket_size=bucket_size, align=align, strategy=strategy, shard_group_size=k
    )
    plan.check(specs)
    verify(plan, specs)
    assert (plan.strategy, plan.align, plan.bucket_size) == (strategy, align, bucket_size)


# ---------------------------------------------------------------- Plan.check catches breakage


def good_plan() -> tuple[Plan, list[ParamSpec]]:
    specs = [spec("emb", 50, 4, matrix=False), spec("w", 16, 16), spec("b", 30), spec("g", 5)]
    return plan_exactly(specs, 2, align=8, bucket_size=ONE_BUCKET), specs


def with_adamw(plan: Plan, **changes: object) -> Plan:
    muon, adamw = plan.buffers
    return dataclasses.replace(plan, buffers=(muon, dataclasses.replace(adamw, **changes)))


def move(plan: Plan, name: str, **changes: int | None) -> Plan:
    adamw = plan.buffers[1]
    placements = tuple(
        dataclasses.replace(p, **changes) if p.name == name else p for p in adamw.placements
    )
    return with_adamw(plan, placements=placements)


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda P: move(P, "b", owner=0), "owner None"),
        (lambda P: move(P, "b", start=9, end=39), "align"),
        (lambda P: move(P, "emb", end=P.buffers[1].placements[0].end - 1), "shape"),
        (lambda P: move(P, "b", start=16, end=46), "tightly"),
        (
            lambda P: with_adamw(
                P,
                buckets=(dataclasses.replace(P.buffers[1].buckets[0], end=480, shard_numel=240),),
            ),
            "pads",
        ),
        (
            lambda P: with_adamw(
                P, buckets=(dataclasses.replace(P.buffers[1].buckets[0], shard_numel=4),)
            ),
            "multiple of align",
        ),
        (
            lambda P: dataclasses.replace(P, buffers=P.buffers[::-1]),
            "at most one per kind, in the order",
        ),
        (lambda P: dataclasses.replace(P, shard_group_size=3), "must divide"),
        (lambda P: with_adamw(P, kind="sgd"), "kind"),
    ],
)
def test_check_catches_broken_plans(breakage, message: str) -> None:
    plan, specs = good_plan()
    plan.check(specs)
    with pytest.raises(AssertionError, match=message):
        breakage(plan).check(specs)


def test_check_catches_specs_out_of_order_or_in_the_wrong_buffer() -> None:
    plan, specs = good_plan()
    assert [(p.name, p.start) for p in plan.buffers[1].placements] == [
        ("emb", 40),
        ("b", 8),
        ("g", 0),
    ]
    with pytest.raises(AssertionError, match="registration order"):
        plan.check([specs[2], specs[0], specs[1], specs[3]])
    rerouted = [dataclasses.replace(s, matrix=not s.matrix) if s.name == "b" else s for s in specs]
    with pytest.raises(AssertionError):
        plan.check(rerouted)


def test_check_catches_elementwise_buckets_out_of_backprop_order() -> None:
    a = Placement("a", (8,), 1, 8, 16, None)
    b = Placement("b", (8,), 0, 0, 8, None)
    buckets = (Bucket(0, 0, 8, 8), Bucket(1, 8, 16, 8))
    ok = Buffer("adamw", 1, 8, buckets, (a, b))
    ok.check()
    swapped = Buffer(
        "adamw", 1, 8, buckets, (dataclasses.replace(a, bucket=0, start=0, end=8),
                                 dataclasses.replace(b, bucket=1, start=8, end=16))
    )  # fmt: skip
    with pytest.raises(AssertionError, match="backprop order"):
        swapped.check()
