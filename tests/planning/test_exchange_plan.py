"""The exchange strategy's plan ([Note: exchange buffers]): one buffer of per-layer buckets in
equal shards, matrices dealt by the owners strategy's rule, and the segments the exchange moves."""

from __future__ import annotations

import pytest

from wholeshard.capacity.presets import PRESETS
from wholeshard.planning import ParamSpec, plan_exactly
from wholeshard.planning._exchange import matrix_ranges, segments
from wholeshard.planning.specs import layer_of
from wholeshard.planning.sync import exchange, exchange_batches


def _toy() -> list[ParamSpec]:
    specs = [ParamSpec("embed.weight", (50, 16), matrix=False, tied=True)]
    for i in range(3):
        specs += [
            ParamSpec(f"layers.{i}.norm.weight", (16,), matrix=False),
            ParamSpec(f"layers.{i}.attn.weight", (48, 16), matrix=True),
            ParamSpec(f"layers.{i}.experts.w", (4, 24, 16), matrix=True),
            ParamSpec(f"layers.{i}.bias", (24,), matrix=False),
        ]
    return [*specs, ParamSpec("norm.weight", (16,), matrix=False)]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_one_buffer_per_layer_buckets_and_whole_matrices(k: int) -> None:
    specs = _toy()
    plan = plan_exactly(specs, k, bucket_size=1, strategy="exchange", align=8)
    (buffer,) = plan.buffers
    assert buffer.kind == "exchange"
    layers = [{layer_of(p.name) for p in buffer.placements if p.bucket == b.index}
              for b in buffer.buckets]  # fmt: skip
    assert all(len(names) == 1 for names in layers)  # a bucket per layer (bucket_size 1)
    assert all(b.exchanged and b.numel == k * b.shard_numel for b in buffer.buckets)
    for p in buffer.placements:
        assert p.end <= buffer.buckets[p.bucket].end  # never spans buckets
    # Every matrix is owned whole by one rank; every element-wise element by its holder.
    owned = {r: list(buffer.owned(r)) for r in range(k)}
    for p, lo, hi, owner in matrix_ranges(buffer):
        assert (p, lo - p.start, hi - lo) in owned[owner]
    covered = sum(n for pieces in owned.values() for _, _, n in pieces)
    assert covered == buffer.used


@pytest.mark.parametrize("preset", ["llama3-8b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("dp", [64, 1024])
def test_owners_are_the_owner_strategys_and_each_element_crosses_once(preset: str, dp: int):
    specs = PRESETS[preset]()
    plan = plan_exactly(specs, dp, bucket_size=40_000_000, strategy="exchange")
    owners = plan_exactly(specs, dp, bucket_size=40_000_000, strategy="owners")
    # Dealt one matrix at a time, stacks too (the owners strategy cuts stacks into runs).
    assert max(plan.rank_costs()) <= max(owners.rank_costs())
    (buffer,) = plan.buffers
    segs = segments(buffer)
    matrices = sum(hi - lo for _, lo, hi, _ in matrix_ranges(buffer))
    assert sum(s.numel for s in segs) <= matrices
    owned = [0] * dp
    for _, lo, hi, owner in matrix_ranges(buffer):
        owned[owner] += hi - lo
    for rank in (0, 1, dp // 2, dp - 1):
        a2a = exchange(segs, dp, rank, "float32", to_owners=True)
        back = exchange(segs, dp, rank, "bfloat16", to_owners=False)
        assert a2a.received <= owned[rank]  # no owner receives more than it owns
        assert (back.numel, back.received) == (a2a.received, a2a.numel)
        assert a2a.numel <= max(b.shard_numel for b in buffer.buckets) * len(buffer.buckets)


def test_batches_cover_the_buckets_in_order() -> None:
    assert exchange_batches(5, None) == [range(0, 5)]
    assert exchange_batches(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]


@pytest.mark.parametrize("shape", [(), (7,)])
def test_a_muon_param_of_fewer_than_two_dims_is_owned_whole(shape: tuple[int, ...]) -> None:
    """Routed to Muon by a shapes file, a scalar or vector has no matrix: one rank owns it
    whole, as in a "matrix" buffer (found by tests/cli/test_fuzz_cli.py)."""
    specs = [ParamSpec("a.w", (6, 4), matrix=True), ParamSpec("a.v", shape, matrix=True)]
    plan = plan_exactly(specs, 2, bucket_size=1, strategy="exchange", align=8)
    (buffer,) = plan.buffers
    vector = buffer.placements[1]
    assert len(vector.owners) == 1 and vector.owner is None
    (owned,) = [piece for r in range(2) for piece in buffer.owned(r) if piece[0] == vector]
    assert owned == (vector, 0, vector.numel)
