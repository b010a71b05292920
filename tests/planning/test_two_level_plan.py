"""Two-level groups in the planning core ([Note: two-level groups] in `planning.plan`): the shard
index of each rank, which plans take them and the errors that say why not, and the sync
description's two stages."""

from __future__ import annotations

import dataclasses

import pytest

from wholeshard.capacity.presets import preset
from wholeshard.planning import ParamSpec, plan_exactly, plan_for
from wholeshard.planning.plan import shard_holder, shard_index, two_level
from wholeshard.planning.sync import Collective, exchange, unit_gather, unit_reduce
from wholeshard.planning.sync import two_level as two_stages

SPECS = [ParamSpec(f"layers.{i}.w", (24, 16), matrix=True) for i in range(6)]
SPECS += [ParamSpec("norm.weight", (16,), matrix=False)]


@pytest.mark.parametrize(("k", "n"), [(4, 2), (8, 2), (8, 4), (12, 3), (6, 1)])
def test_the_shard_index_is_local_times_nodes_plus_node_and_inverts(k: int, n: int) -> None:
    shards = [shard_index(r, k, n) for r in range(k)]
    assert sorted(shards) == list(range(k))
    assert [shard_holder(s, k, n) for s in shards] == list(range(k))
    m = k // n
    assert all(shard_index(j * n + local, k, n) == local * m + j
               for j in range(m) for local in range(n))  # fmt: skip


def test_a_plan_in_two_levels_is_the_one_level_plan_with_its_shards_dealt_again() -> None:
    one = plan_exactly(SPECS, 16, bucket_size=1000, strategy="exchange", shard_group_size=8)
    two = plan_exactly(SPECS, 16, bucket_size=1000, strategy="exchange", shard_group_size=8,
                       node_size=2)  # fmt: skip
    assert two == dataclasses.replace(one, node_size=2) and one.node_size == 1
    assert [two.shard_rank(r) for r in range(16)] == [0, 4, 1, 5, 2, 6, 3, 7] * 2
    assert [two.group_rank(s) for s in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    # a shard group inside one node (k <= n) has one level
    assert plan_exactly(SPECS, 4, bucket_size=1000, node_size=8).node_size == 1


@pytest.mark.parametrize(
    ("kw", "said"),
    [
        (dict(node_size=3), "does not divide the shard group size 8"),
        (dict(node_size=0), "node_size must be None or an int >= 1"),
        (dict(node_size=2, strategy="owners"), "pass strategy='exchange'"),
    ],
)
def test_a_structure_that_does_not_fit_is_refused_with_the_fix(kw: dict, said: str) -> None:
    kw = {"strategy": "exchange", **kw}
    with pytest.raises(ValueError, match=said):
        plan_exactly(SPECS, 8, bucket_size=1000, **kw)


def test_automatic_strategy_in_two_levels_never_plans_owner_buckets() -> None:
    """llama3-8b at dp 16: balanced misses the bucket bound, so the fallback plans, which is
    owner buckets below 64 ranks in one level, the exchange in two."""
    specs = preset("llama3-8b")
    assert plan_for(specs, 16).strategy == "owners"
    plan = plan_for(specs, 16, node_size=8)
    assert (plan.strategy, plan.node_size) == ("exchange", 8)
    assert two_level(plan, None).node_size == 1


def test_each_reduce_scatter_and_all_gather_runs_in_two_stages() -> None:
    plan = plan_exactly(SPECS, 8, bucket_size=1000, strategy="exchange", node_size=2)
    buckets = plan.buffers[0].buckets
    one = unit_reduce(buckets, 8, 1, 0, "float32")
    two = unit_reduce(buckets, 8, 1, 0, "float32", node=2)
    assert [(c.op, c.ranks, c.numel, c.group) for c in two] == [
        row for c in one for row in (("reduce_scatter", 2, c.numel, "node"),
                                     ("reduce_scatter", 4, c.numel // 2, "cross"))
    ]  # fmt: skip
    gathers = unit_gather(buckets, 8, "bfloat16", node=2)
    assert [(c.op, c.ranks, c.group) for c in gathers[:2]] == [
        ("all_gather", 4, "cross"), ("all_gather", 2, "node")
    ]  # fmt: skip
    a2a = exchange([], 8, 0, "float32", True)
    replica = Collective("all_reduce", 2, 10, "float32", "grads", "replica")
    assert two_stages([a2a, replica], 2) == [a2a, replica]  # only the shard group's stages
    assert two_stages(one, 1) == one


def test_automatic_shard_groups_keep_whole_nodes() -> None:
    """llama3-70b at dp 192: `shard_group_size="auto"` picks k = 96, which nodes of 64 cannot
    make whole; with `node_size=64` the ladder passes over it to 64 (one node: one level)."""
    specs = preset("llama3-70b")
    assert plan_for(specs, 192, shard_group_size="auto").shard_group_size == 96
    plan = plan_for(specs, 192, shard_group_size="auto", node_size=64)
    assert (plan.shard_group_size, plan.node_size) == (64, 1)
