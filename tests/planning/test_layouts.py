"""The one extension point ([Note: layouts] in `wholeshard/planning/layouts.py`): a registered
layout's plan, sync schemes and buffer kind reach the plan, its checks, the cost model and the
engine's lookup; an unregistered name is refused with the fix. The bench's legacy baselines
(`wholeshard.bench.baselines`) are the registered layouts the engine tests train end to end
(`tests/engine/test_overlap.py`, `test_plan_agrees.py`, ...)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

import wholeshard.bench.baselines as baselines
from wholeshard.capacity.costs import plan_costs
from wholeshard.capacity.presets import preset
from wholeshard.engine.config import ConfigError, Variant
from wholeshard.engine.layouts import Executable, load
from wholeshard.planning import Plan, plan_for
from wholeshard.planning.buffer import register_kind
from wholeshard.planning.layouts import LAYOUTS, Layout, layout_named, register_layout
from wholeshard.planning.sync import (
    SYNC_SCHEMES,
    Collective,
    SyncScheme,
    unit_gather,
    unit_reduce,
)

SPECS = preset("gpt2-small")


def _all_reduce(b, k: int, dtype: str) -> list[Collective]:
    return [Collective("all_reduce", k, b.numel, dtype, "grads", "shard")]


def _nothing(b, k: int, dtype: str) -> list[Collective]:
    return []


REPLICATED = SyncScheme("test_replicated", _all_reduce, _nothing, "all_reduce")


def _replicate(plan: Plan, specs) -> Plan:
    """Every bucket all-reduced whole, nothing gathered (a test scheme, described only)."""
    renamed = (
        dataclasses.replace(
            f, buckets=tuple(dataclasses.replace(b, scheme=REPLICATED.name) for b in f.buckets)
        )  # fmt: skip
        for f in plan.buffers
    )
    return dataclasses.replace(plan, buffers=tuple(renamed))


TEST_LAYOUT = Layout("test_replicated", _replicate, (REPLICATED,), lambda: Executable())


@pytest.fixture
def registered() -> Iterator[None]:
    """`TEST_LAYOUT` registered for one test (other tests see the registries as the bench's)."""
    register_layout(TEST_LAYOUT)
    yield
    del LAYOUTS[TEST_LAYOUT.name], SYNC_SCHEMES[REPLICATED.name]


def test_a_registered_layout_rewrites_the_plan_and_its_scheme_is_priced(registered) -> None:
    register_layout(TEST_LAYOUT)  # the same again: a no-op
    plan = plan_for(SPECS, 4, layout="test_replicated", strategy="balanced")
    design = plan_for(SPECS, 4, strategy="balanced")
    assert plan.sync_schemes() == {"test_replicated"} and plan.numel == design.numel
    buckets = [b for f in plan.buffers for b in f.buckets]
    counts = plan_costs(plan, SPECS).counts()
    assert counts["all_reduce"] == len(buckets) + 2  # + the step check and the grad norm
    assert "all_gather" not in counts and "reduce_scatter" not in counts
    assert [c.op for c in unit_reduce(buckets[:2], 4, 1, 0, "float32")] == ["all_reduce"] * 2
    assert unit_gather(buckets[:2], 4, "float32") == []
    with pytest.raises(ValueError, match="a different layout is registered as 'test_replicated'"):
        register_layout(dataclasses.replace(TEST_LAYOUT, strategy="owners"))
    with pytest.raises(ValueError, match="engine half lacks .* 'test_replicated'"):
        load(TEST_LAYOUT)  # a description without its executable half never runs


def test_an_unregistered_layout_is_refused_saying_what_is_registered_and_how() -> None:
    fix = r"\(registered: \[.*'ping_pong'.*\]\); register one with .*register_layout.*" + (
        r"import wholeshard.bench.baselines"
    )
    with pytest.raises(ValueError, match="layout 'zigzag' is not registered " + fix):
        plan_for(SPECS, 4, layout="zigzag")
    with pytest.raises(ConfigError, match="layout 'zigzag' is not registered") as e:
        Variant(layout="zigzag")
    assert e.value.field == "layout"


def test_a_buffer_kind_is_registered_once() -> None:
    with pytest.raises(ValueError, match="buffer kind 'matrix' is taken"):
        register_kind("matrix", "whole tensors")
    with pytest.raises(ValueError, match="buffer kind 'unaligned' is taken"):
        register_kind(baselines.KIND, "something else")


def test_two_levels_name_the_scheme_that_cannot_take_them() -> None:
    for name in ("ping_pong", "shard_broadcasts"):
        with pytest.raises(ValueError, match=f"syncs buckets by '{name}'; leave node_size unset"):
            plan_for(SPECS, 8, layout=name, node_size=2, strategy="balanced")
    with pytest.raises(ValueError, match="by 'owners'; pass strategy='exchange'"):
        plan_for(SPECS, 8, strategy="owners", node_size=2)


def test_the_ping_pong_description_is_its_unaligned_buffer() -> None:
    """One all-reduce of each bucket, and an all-gather padded to the rank owning the most of
    it (or one broadcast per owning rank): sizes from the placements' owners."""
    for layout, gather in (("ping_pong", "all_gather"), ("ping_pong_broadcasts", "broadcast")):
        plan = plan_for(SPECS, 4, layout=layout, bucket_size=1 << 22)
        (buffer,) = plan.buffers
        assert (buffer.kind, plan.strategy, plan.align) == ("unaligned", "size_match", 1)
        assert layout_named(layout).refuses and plan.padding_fraction == 0
        for b in buffer.buckets:
            owned = [0] * 4
            for p in buffer.placements:
                owned[p.owner] += p.numel if p.bucket == b.index else 0
            assert [(c.op, c.numel) for c in unit_reduce((b,), 4, 1, 0, "float32")] == [
                ("all_reduce", b.numel)
            ]
            sizes = [4 * max(owned)] if gather == "all_gather" else [n for n in owned if n]
            assert [(c.op, c.numel) for c in unit_gather((b,), 4, "float32")] == [
                (gather, n) for n in sizes
            ]
    with pytest.raises(ValueError, match="'ping_pong' has no shard groups"):
        plan_for(SPECS, 4, layout="ping_pong", shard_group_size=2)
