"""The sync schemes' descriptions ([Note: sync schemes] in `wholeshard/planning/sync.py`): which
scheme a bucket names, what each issues, in order, and that the engine has a half for each.
`tests/engine/test_plan_agrees.py` checks the descriptions against recorded runs; the bench's
baselines (`wholeshard.bench.baselines`) are the registered schemes here."""

from __future__ import annotations

import dataclasses

import pytest

from wholeshard.bench.baselines import LAYOUTS, SHARD_BROADCASTS
from wholeshard.engine._sync import HALVES
from wholeshard.engine.layouts import load
from wholeshard.planning import Bucket
from wholeshard.planning.sync import (
    CORE_SCHEMES,
    EQUAL_SHARDS,
    OWNERS,
    SYNC_SCHEMES,
    register_scheme,
    scheme_of,
    unit_gather,
    unit_reduce,
)

EQUAL = Bucket(0, 0, 12, 3)  # 4 equal shards of 3
OWNED = Bucket(1, 12, 22, 0, ((1, 12), (3, 15)))  # ranks 1 and 3 own 3 and 7 elements


def test_a_bucket_names_its_scheme_or_a_registered_one() -> None:
    assert (EQUAL.sync, OWNED.sync) == ("equal_shards", "owners")
    assert scheme_of(EQUAL) is EQUAL_SHARDS and scheme_of(OWNED) is OWNERS
    named = dataclasses.replace(EQUAL, scheme="shard_broadcasts")
    assert scheme_of(named) is SHARD_BROADCASTS
    with pytest.raises(ValueError, match="'zigzag', which is not registered .*import wholeshard"):
        scheme_of(dataclasses.replace(EQUAL, scheme="zigzag"))
    register_scheme(SHARD_BROADCASTS)  # the same again: a no-op
    with pytest.raises(ValueError, match="a different sync scheme"):
        register_scheme(dataclasses.replace(SHARD_BROADCASTS, words="other"))


def test_every_scheme_has_an_executable_half_once_its_layout_is_loaded() -> None:
    assert {s.name for s in CORE_SCHEMES} <= set(HALVES)
    for layout in LAYOUTS:
        load(layout)
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
    broadcast = dataclasses.replace(EQUAL, scheme="shard_broadcasts")
    gathers = unit_gather((broadcast, OWNED), 4, "bfloat16")
    assert [(c.op, c.numel) for c in gathers] == [("broadcast", 3)] * 4 + [
        ("broadcast_coalesced", 10)
    ]
    assert [c.op for c in unit_gather((EQUAL, OWNED), 4, "bfloat16")] == [
        "all_gather",
        "broadcast_coalesced",
    ]
    assert {c.dtype for c in gathers} == {"bfloat16"}
