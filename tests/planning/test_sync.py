"""The sync schemes' descriptions ([Note: sync schemes] in `wholeshard/planning/sync.py`): which
scheme a bucket names, what each issues, in order, and that the engine has a half for each.
`tests/engine/test_plan_agrees.py` checks the descriptions against recorded runs."""

from __future__ import annotations

from wholeshard.engine._sync import HALVES
from wholeshard.planning import Bucket
from wholeshard.planning.sync import (
    EQUAL_SHARDS,
    OWNERS,
    SHARD_BROADCASTS,
    SYNC_SCHEMES,
    sync_scheme,
    unit_gather,
    unit_reduce,
)

EQUAL = Bucket(0, 0, 12, 3)  # 4 equal shards of 3
OWNED = Bucket(1, 12, 22, 0, ((1, 12), (3, 15)))  # ranks 1 and 3 own 3 and 7 elements


def test_a_bucket_names_its_scheme_and_the_broadcast_baseline_only_changes_equal_shards() -> None:
    assert (EQUAL.sync, OWNED.sync) == ("equal_shards", "owners")
    assert sync_scheme(EQUAL) is EQUAL_SHARDS and sync_scheme(OWNED) is OWNERS
    assert sync_scheme(EQUAL, "broadcast") is SHARD_BROADCASTS
    assert sync_scheme(OWNED, "broadcast") is OWNERS  # an owner bucket broadcasts anyway


def test_every_scheme_has_an_executable_half() -> None:
    assert set(HALVES) == set(SYNC_SCHEMES)


def test_a_unit_reduces_every_bucket_then_its_nonempty_shards_across_replicas() -> None:
    ops = [
        (c.op, c.ranks, c.numel, c.group) for c in unit_reduce((EQUAL, OWNED), 4, 2, 3, "bfloat16")
    ]
    assert ops == [
        ("reduce_scatter", 4, 12, "shard"),
        ("reduce_coalesced", 4, 10, "shard"),
        ("all_reduce", 2, 3, "replica"),  # rank 3's shard of EQUAL
        ("all_reduce", 2, 7, "replica"),  # and of OWNED
    ]
    rank_0 = unit_reduce((EQUAL, OWNED), 4, 2, 0, "bfloat16")
    assert [c.numel for c in rank_0 if c.group == "replica"] == [3]  # owns nothing of OWNED
    assert len(unit_reduce((EQUAL, OWNED), 4, 1, 0, "bfloat16")) == 2  # no replicas


def test_a_unit_gathers_each_bucket_by_its_scheme() -> None:
    gathers = unit_gather((EQUAL, OWNED), 4, "bfloat16", "broadcast")
    assert [(c.op, c.numel) for c in gathers] == [("broadcast", 3)] * 4 + [
        ("broadcast_coalesced", 10)
    ]
    assert [c.op for c in unit_gather((EQUAL, OWNED), 4, "bfloat16")] == [
        "all_gather",
        "broadcast_coalesced",
    ]
    assert {c.dtype for c in gathers} == {"bfloat16"}
