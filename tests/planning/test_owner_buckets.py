"""Owner buckets ([Note: owner buckets] in `wholeshard/planning/specs.py`) and the owners
strategy ([Note: owners strategy] in `_owners.py`): the bucket's shard rule, and plans of whole
tensors and of stacks that keep every invariant, bound their buckets and balance their owners."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wholeshard.planning import Bucket, ParamSpec, plan_exactly
from wholeshard.planning.specs import matrices, matrix_shape, ns_cost, round_up
from wholeshard.planning.targets import largest_unit


def test_a_bucket_lists_its_owners_and_the_others_hold_empty_shards() -> None:
    b = Bucket(3, 100, 200, 0, ((1, 100), (4, 164)))
    assert b.owners and b.numel == 100
    assert [b.shard(r) for r in range(6)] == [
        (100, 100), (100, 164), (164, 164), (164, 164), (164, 200), (200, 200),
    ]  # fmt: skip
    assert [b.shard_len(r) for r in range(6)] == [0, 64, 0, 0, 36, 0]
    assert list(b.shards()) == [(1, 100, 164), (4, 164, 200)]
    assert [b.owner(e) for e in (100, 163, 164, 199)] == [1, 1, 4, 4]
    equal = Bucket(0, 0, 12, 4)
    assert not equal.owners and list(equal.shards()) == [(0, 0, 4), (1, 4, 8), (2, 8, 12)]


@st.composite
def stacks(draw: st.DrawFn) -> list[ParamSpec]:
    """1..6 stacks of (E, m, n) matrices, E up to 40, among a few 2-D and 1-D params."""
    specs = []
    for i in range(draw(st.integers(1, 6))):
        e, m, n = draw(st.integers(1, 40)), draw(st.integers(1, 48)), draw(st.integers(1, 48))
        specs.append(ParamSpec(f"layers.{i}.experts.w", (e, m, n), matrix=True))
        specs.append(ParamSpec(f"layers.{i}.norm", (m,), matrix=False))
    return specs


@settings(max_examples=60, deadline=None)
@given(specs=stacks(), k=st.integers(1, 64), bucket_size=st.integers(64, 20_000))
def test_stacks_in_owner_buckets_run_contiguously_and_balance(
    specs: list[ParamSpec], k: int, bucket_size: int
) -> None:
    plan = plan_exactly(specs, k, bucket_size=bucket_size, strategy="owners")
    stacked = next(b for b in plan.buffers if b.kind == "stacked")
    # Every storage unit is one stack, and no bucket is padded beyond alignment.
    assert len(stacked.storage_units()) == len(stacked.placements)
    assert stacked.numel == sum(round_up(p.numel, 64) for p in stacked.placements)
    # Owners are contiguous runs, in buffer order, each within one matrix of its share.
    owners = [
        (m.start, m.owner, ns_cost(matrix_shape(p.shape)))
        for p in stacked.placements
        for m in matrices(p, stacked.buckets)
    ]
    order = [owner for _, owner, _ in sorted(owners)]
    assert order == sorted(order)
    costs = [0] * k
    for _, owner, cost in owners:
        costs[owner] += cost
    widest = max(cost for _, _, cost in owners)
    assert max(costs) <= sum(costs) / k + widest


@pytest.mark.core
@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 64), st.integers(1, 64)), min_size=1, max_size=60),
    k=st.integers(1, 96),
    bucket_size=st.integers(64, 20_000),
)
def test_whole_tensors_in_owner_buckets_are_bounded_unpadded_and_dealt_by_cost(
    shapes: list[tuple[int, int]], k: int, bucket_size: int
) -> None:
    specs = [ParamSpec(f"l{i}.w", shape, matrix=True) for i, shape in enumerate(shapes)]
    plan = plan_exactly(specs, k, bucket_size=bucket_size, strategy="owners")
    [muon] = plan.buffers
    widest = max(round_up(math.prod(s), 64) for s in shapes)
    assert largest_unit(plan) < bucket_size + widest  # closes once it holds bucket_size
    assert muon.numel == sum(round_up(math.prod(s), 64) for s in shapes)  # no padding
    # Dealt costliest first to the least loaded: no rank exceeds the mean by the costliest one.
    costs = muon.rank_costs()
    assert max(costs) <= sum(costs) / k + max(ns_cost(s) for s in shapes)
    # A bucket holds its params owner by owner, so each rank's shard is one range.
    for b in muon.buckets:
        members = sorted((p.start, p.owner) for p in muon.placements if p.bucket == b.index)
        assert [owner for _, owner in members] == sorted(owner for _, owner in members)


@pytest.mark.parametrize("dp", [64, 256, 1024])
def test_owner_buckets_need_no_room_per_rank(dp: int) -> None:
    """Equal shards of whole matrices make a bucket of at least dp times the widest; owner
    buckets stay at the bucket size."""
    specs = [
        ParamSpec(f"layers.{i}.w{j}", (1024, 1024), matrix=True) for i in range(8) for j in range(4)
    ]
    equal = plan_exactly(specs, dp, bucket_size=4_000_000, strategy="balanced")
    owned = plan_exactly(specs, dp, bucket_size=4_000_000, strategy="owners")
    assert largest_unit(equal) >= dp * 1024 * 1024
    assert largest_unit(owned) <= 4 * 1024 * 1024 and owned.padding_fraction == 0
    assert len({p.owner for p in owned.buffers[0].placements}) == min(dp, len(specs))
