"""The whole-tensor ("matrix") buffer: every invariant is re-checked here independently of
`Buffer.check`, and the planner is compared with a naive reference of the size-matching rule."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import round_up, shape_lists, spec, spec_lists, verify_whole_buffer, whole_buffer

from wholeshard.planning import Bucket, Buffer, ParamSpec, Placement
from wholeshard.planning._packing import FirstFit


def aligned_total(specs: list[ParamSpec], align: int) -> int:
    return sum(round_up(s.numel, align) for s in specs)


def verify(buffer: Buffer, specs: list[ParamSpec], bucket_size: int | None = None) -> None:
    """`verify_whole_buffer`, and the size-matching rule for closing buckets."""
    verify_whole_buffer(buffer, specs)
    dp, align, buckets = buffer.shard_group_size, buffer.align, buffer.buckets
    members: list[list[int]] = [[] for _ in buckets]
    for i, p in enumerate(buffer.placements):
        members[p.bucket].append(i)

    # Bucket cutting: a bucket is closed as soon as it reaches bucket_size, so dropping its last
    # row (at most its widest param wide) brings it below bucket_size.
    if bucket_size is not None:
        tied_bucket = [specs[idx[0]].tied for idx in members]
        for i, (b, idx) in enumerate(zip(buckets, members, strict=True)):
            widest = max(round_up(specs[k].numel, align) for k in idx)
            assert b.numel - dp * widest < bucket_size
            if i + 1 < len(buckets) and not tied_bucket[i] and not tied_bucket[i + 1]:
                assert b.numel >= bucket_size, f"bucket {i} closed early"
    else:
        untied = [b for b, idx in zip(buckets, members, strict=True) if not specs[idx[0]].tied]
        tied_runs = sum(1 for s in specs if s.tied)
        assert len(buckets) <= 2 * tied_runs + 1
        # Between two tied buckets there is at most one untied bucket.
        assert len(untied) <= tied_runs + 1


def reference_plan(
    specs: list[ParamSpec], dp: int, bucket_size: int | None, align: int
) -> dict[str, tuple[int, int, int]]:
    """The size-matching rule written as plainly as possible (quadratic). Name -> (bucket,
    start, owner)."""
    n = len(specs)
    order = list(range(n - 1, -1, -1))
    size = [round_up(s.numel, align) for s in specs]
    taken: set[int] = set()
    buckets: list[list[tuple[int, list[tuple[int, int, int]]]]] = []
    current: list[tuple[int, list[tuple[int, int, int]]]] = []
    for seed in order:
        if seed in taken:
            continue
        taken.add(seed)
        width = size[seed]
        if specs[seed].tied:
            if current:
                buckets.append(current)
            buckets.append([(width, [(0, seed, 0)])])
            current = []
            continue
        row = [(0, seed, 0)]
        for rank in range(1, dp):
            free = [q for q in order if q not in taken and not specs[q].tied]
            match = [q for q in free if specs[q].numel == specs[seed].numel]
            if match:
                taken.add(match[0])
                row.append((rank, match[0], 0))
                continue
            used = 0
            for q in free:
                if size[q] <= width - used:
                    taken.add(q)
                    row.append((rank, q, used))
                    used += size[q]
        current.append((width, row))
        if bucket_size is not None and dp * sum(w for w, _ in current) >= bucket_size:
            buckets.append(current)
            current = []
    if current:
        buckets.append(current)

    out: dict[str, tuple[int, int, int]] = {}
    start = 0
    for index, rows in enumerate(buckets):
        shard = sum(w for w, _ in rows)
        offset = 0
        for width, row in rows:
            for rank, q, slot_offset in row:
                out[specs[q].name] = (index, start + rank * shard + offset + slot_offset, rank)
            offset += width
        start += dp * shard
    return out


def transformer_block(i: int, d: int = 128) -> list[ParamSpec]:
    """A GPT-2-style block d wide, in registration order: each layer's weight, then its bias."""
    layers = [
        ("ln_1", (d,)),
        ("attn.qkv", (3 * d, d)),
        ("attn.proj", (d, d)),
        ("ln_2", (d,)),
        ("mlp.fc", (4 * d, d)),
        ("mlp.fc2", (d, 4 * d)),
    ]
    specs = []
    for name, shape in layers:
        specs += [spec(f"h.{i}.{name}.weight", *shape), spec(f"h.{i}.{name}.bias", shape[0])]
    return specs


# ---------------------------------------------------------------- concrete size-matching cases


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_uniform_stack_has_no_padding_beyond_alignment(dp: int) -> None:
    specs = [s for i in range(8) for s in transformer_block(i)]
    buffer = whole_buffer(specs, dp)
    verify(buffer, specs)
    assert buffer.numel == aligned_total(specs, 64)
    assert buffer.padding_fraction == 0.0  # every size here is a multiple of 64
    assert len(buffer.buckets) == 1


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_uniform_stack_with_small_buckets_has_no_padding_beyond_alignment(dp: int) -> None:
    specs = [s for i in range(8) for s in transformer_block(i)]
    buffer = whole_buffer(specs, dp, bucket_size=100_000)
    verify(buffer, specs, bucket_size=100_000)
    assert len(buffer.buckets) > 1
    assert buffer.numel == aligned_total(specs, 64)


@pytest.mark.parametrize("dp", [2, 3, 5])
def test_counts_multiple_of_dp_give_no_padding_beyond_alignment(dp: int) -> None:
    shapes = [(7,), (100, 3), (65,), (1,), (64, 64)]
    specs = [spec(f"p{k}.{j}", *shapes[(k * 7 + j) % 5]) for k in range(dp) for j in range(5)]
    buffer = whole_buffer(specs, dp, align=16)
    verify(buffer, specs)
    assert buffer.numel == aligned_total(specs, 16)


def test_unique_seed_gets_following_params_packed_before_padding() -> None:
    # Backprop order: big (640), e (256), d (128), c (64), b (192), a (128).
    specs = [
        spec("a", 2, 64),
        spec("b", 3, 64),
        spec("c", 64),
        spec("d", 2, 64),
        spec("e", 4, 64),
        spec("big", 10, 64),
    ]
    buffer = whole_buffer(specs, 3)
    verify(buffer, specs)
    assert len(buffer.buckets) == 1 and buffer.buckets[0].shard_numel == 640
    at = {p.name: (p.owner, p.start - 640 * p.owner) for p in buffer.placements}
    # Shard 1 takes e, d, c, b in backprop order until the slot is full; shard 2 takes a.
    assert at == {
        "big": (0, 0),
        "e": (1, 0),
        "d": (1, 256),
        "c": (1, 384),
        "b": (1, 448),
        "a": (2, 0),
    }
    assert buffer.numel == 3 * 640


def test_packing_skips_params_that_do_not_fit_and_takes_later_ones() -> None:
    # Backprop order: big (640), x (512), y (512), z (128).
    specs = [spec("z", 128), spec("y", 512), spec("x", 512), spec("big", 640)]
    buffer = whole_buffer(specs, 3)
    verify(buffer, specs)
    owner = {p.name: p.owner for p in buffer.placements}
    assert owner == {"big": 0, "x": 1, "z": 1, "y": 2}
    assert buffer.numel == 3 * 640


def test_exact_numel_partner_beats_packing() -> None:
    # A same-numel partner far back in backprop order (first registered) is preferred over
    # the smaller params right behind the seed.
    specs = [spec("partner", 8, 64), spec("s1", 64), spec("s2", 64), spec("seed", 64, 8)]
    buffer = whole_buffer(specs, 2)
    verify(buffer, specs)
    owner = {p.name: (p.bucket, p.owner) for p in buffer.placements}
    assert owner["seed"] == (0, 0) and owner["partner"] == (0, 1)
    assert buffer.buckets[0].shard_numel == 512 + 64  # second row: s2 seeds, s1 partners it


def test_row_without_anything_to_pack_is_padded() -> None:
    specs = [spec("large", 1000), spec("small", 10)]  # backprop: small first, nothing fits
    buffer = whole_buffer(specs, 4, align=1)
    verify(buffer, specs)
    assert buffer.buckets[0].shard_numel == 10 + 1000
    assert buffer.numel == 4 * 1010


def test_tied_param_gets_an_isolated_bucket() -> None:
    specs = [
        spec("wte", 1000, 64, tied=True),
        spec("a", 64, 64),
        spec("b", 64, 64),
        spec("gate", 100, tied=True),
        spec("c", 32, 64),
        spec("d", 32, 64),
        spec("e", 100),  # same numel as the tied gate, which still must not partner it
    ]
    buffer = whole_buffer(specs, 2)
    verify(buffer, specs)
    buckets = [sorted(p.name for p in buffer.placements if p.bucket == i) for i in range(4)]
    assert len(buffer.buckets) == 4
    assert buckets == [["c", "d", "e"], ["gate"], ["a", "b"], ["wte"]]
    for name, numel in (("wte", 64_000), ("gate", 100)):
        p = buffer.placements[[s.name for s in specs].index(name)]
        b = buffer.buckets[p.bucket]
        assert p.owner == 0 and p.start == b.start
        assert b.shard_numel == round_up(numel, 64)  # shard 1 is padding
    assert buffer.buckets[0].shard_numel == 128 + 2048  # row e (padded), row d | c


def test_tied_params_in_a_real_stack_stay_isolated() -> None:
    specs = [spec("wte", 1000, 64, tied=True)] + transformer_block(0) + transformer_block(1)
    specs.insert(13, spec("shared_gate", 100, tied=True))
    for bucket_size in (None, 50_000):
        buffer = whole_buffer(specs, 4, bucket_size=bucket_size)
        verify(buffer, specs, bucket_size)
        assert buffer.placements[0].bucket == len(buffer.buckets) - 1


def test_tied_param_at_dp1_has_no_padding() -> None:
    specs = [spec("emb", 50, 3, tied=True), spec("w", 30, 30)]
    buffer = whole_buffer(specs, 1, align=1)
    verify(buffer, specs)
    assert buffer.padding_fraction == 0.0 and len(buffer.buckets) == 2


@pytest.mark.parametrize("bucket_size", [None, 5000])
def test_dp1_has_no_padding_beyond_alignment(bucket_size: int | None) -> None:
    specs = [spec(f"p{i}", 1 + 37 * i % 101, 1 + 13 * i % 29) for i in range(30)]
    buffer = whole_buffer(specs, 1, bucket_size=bucket_size)
    verify(buffer, specs, bucket_size)
    assert buffer.numel == aligned_total(specs, 64)
    assert whole_buffer(specs, 1, bucket_size=bucket_size, align=1).padding_fraction == 0.0


def test_first_bucket_holds_the_last_registered_params() -> None:
    specs = [spec(f"p{i}", 64 * (i + 1)) for i in range(10)]  # distinct sizes: one param per row
    buffer = whole_buffer(specs, 1, bucket_size=1)
    verify(buffer, specs, bucket_size=1)
    assert [p.bucket for p in buffer.placements] == list(range(9, -1, -1))


def test_backprop_order_with_repeated_blocks() -> None:
    specs = [s for i in range(4) for s in transformer_block(i)]
    buffer = whole_buffer(specs, 2, bucket_size=150_000)
    verify(buffer, specs, bucket_size=150_000)
    first = {p.name for p in buffer.placements if p.bucket == 0}
    assert "h.3.mlp.fc2.bias" in first and "h.3.mlp.fc2.weight" in first
    assert "h.0.ln_1.weight" not in first
    assert buffer.placements[-1].bucket == 0


def test_buckets_are_cut_near_bucket_size() -> None:
    specs = [spec(f"w{i}", 64, 64) for i in range(40)]  # rows of 2 * 4096 elements at dp 2
    buffer = whole_buffer(specs, 2, bucket_size=20_000)
    verify(buffer, specs, bucket_size=20_000)
    assert [b.numel for b in buffer.buckets] == [24_576] * 6 + [16_384]


def test_bucket_closes_when_it_reaches_bucket_size_exactly() -> None:
    specs = [spec(f"w{i}", 64, 64) for i in range(12)]
    buffer = whole_buffer(specs, 2, bucket_size=3 * 8192)
    assert [b.numel for b in buffer.buckets] == [3 * 8192, 3 * 8192]


def test_one_bucket_without_bucket_size() -> None:
    specs = [spec(f"w{i}", 64, 64 + i) for i in range(20)]
    buffer = whole_buffer(specs, 4)
    verify(buffer, specs)
    assert len(buffer.buckets) == 1


def test_scalar_params_and_empty_spec_list() -> None:
    specs = [spec("scale"), spec("bias", 3), spec("gain")]
    buffer = whole_buffer(specs, 2, align=1)
    verify(buffer, specs)
    assert [p.shape for p in buffer.placements] == [(), (3,), ()]
    empty = whole_buffer([], 8)
    assert empty.buckets == () and empty.placements == () and empty.numel == 0
    assert empty.padding_fraction == 0.0


def test_placement_fields() -> None:
    specs = transformer_block(0, d=96)
    buffer = whole_buffer(specs, 3, align=32)
    verify(buffer, specs)
    for s, p in zip(specs, buffer.placements, strict=True):
        assert (p.name, p.shape, p.numel) == (s.name, s.shape, s.numel)


# ---------------------------------------------------------------- property-based


@pytest.mark.core
@settings(max_examples=150, deadline=None)
@given(
    specs=spec_lists(),
    dp=st.integers(1, 64),
    bucket_size=st.one_of(st.none(), st.integers(1, 400_000)),
    align=st.sampled_from([1, 8, 64, 100]),
)
def test_random_buffers_keep_invariants_and_match_reference(
    specs: list[ParamSpec], dp: int, bucket_size: int | None, align: int
) -> None:
    buffer = whole_buffer(specs, dp, bucket_size=bucket_size, align=align)
    buffer.check(specs)
    verify(buffer, specs, bucket_size)
    got = {p.name: (p.bucket, p.start, p.owner) for p in buffer.placements}
    assert got == reference_plan(specs, dp, bucket_size, align)
    if dp == 1 or (
        bucket_size is None
        and not any(s.tied for s in specs)
        and all(sum(t.numel == s.numel for t in specs) % dp == 0 for s in specs)
    ):
        assert buffer.numel == aligned_total(specs, align)


@settings(max_examples=60, deadline=None)
@given(shapes=shape_lists(12), dp=st.integers(1, 16), data=st.data())
def test_shapes_repeated_dp_times_have_no_padding_beyond_alignment(
    shapes: list[tuple[int, ...]], dp: int, data: st.DataObject
) -> None:
    copies = [(i, shape) for i, shape in enumerate(shapes) for _ in range(dp)]
    copies = data.draw(st.permutations(copies))
    specs = [ParamSpec(f"s{i}.{k}", shape, matrix=True) for k, (i, shape) in enumerate(copies)]
    buffer = whole_buffer(specs, dp)
    verify(buffer, specs)
    assert buffer.numel == aligned_total(specs, 64)


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=40), data=st.data())
def test_first_fit_tree_matches_linear_scan(sizes: list[int], data: st.DataObject) -> None:
    tree = FirstFit(sizes)
    live = [float(x) for x in sizes]
    position = st.integers(0, len(sizes) - 1)
    for pos in data.draw(st.lists(position, max_size=2 * len(sizes))):
        tree.remove(pos)
        live[pos] = math.inf
        capacity = data.draw(st.integers(0, 55))
        for lo in range(len(live) + 1):
            expected = next((i for i in range(lo, len(live)) if live[i] <= capacity), -1)
            assert tree.first_fit(lo, capacity) == expected


# ---------------------------------------------------------------- Buffer.check catches breakage


def good_buffer() -> tuple[Buffer, list[ParamSpec]]:
    specs = [spec("a", 128), spec("b", 64), spec("c", 64), spec("d", 128)]
    buffer = whole_buffer(specs, 2)
    return buffer, specs


def test_check_catches_param_straddling_shards() -> None:
    bucket = Bucket(index=0, start=0, end=256, shard_numel=128)
    straddler = Placement("w", (192,), bucket=0, start=0, end=192, owner=0)
    buffer = Buffer("matrix", 2, 64, buckets=(bucket,), placements=(straddler,))
    with pytest.raises(AssertionError, match=r"'w'.*straddles shards 0"):
        buffer.check()


def test_check_accepts_a_planned_buffer() -> None:
    buffer, specs = good_buffer()
    buffer.check()
    buffer.check(specs)


def _replace_placement(buffer: Buffer, name: str, **changes: int) -> Buffer:
    placements = tuple(
        dataclasses.replace(p, **changes) if p.name == name else p for p in buffer.placements
    )
    return dataclasses.replace(buffer, placements=placements)


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda L: _replace_placement(L, "a", owner=1 - L.placements[0].owner), "owner"),
        (lambda L: _replace_placement(L, "b", start=1, end=65), "align"),
        (lambda L: _replace_placement(L, "b", end=65), "shape"),
        (
            lambda L: dataclasses.replace(
                L, buckets=(dataclasses.replace(L.buckets[0], shard_numel=100),)
            ),
            "align",
        ),
        (
            lambda L: dataclasses.replace(
                L, buckets=(dataclasses.replace(L.buckets[0], end=L.buckets[0].end + 64),)
            ),
            "shards must be equal",
        ),
        (
            lambda L: dataclasses.replace(
                L, buckets=(dataclasses.replace(L.buckets[0], start=64),)
            ),
            "contiguous",
        ),
        (lambda L: dataclasses.replace(L, placements=L.placements + L.placements[:1]), "twice"),
    ],
)
def test_check_catches_broken_buffers(breakage, message: str) -> None:
    buffer, _ = good_buffer()
    broken = breakage(buffer)
    with pytest.raises(AssertionError, match=message):
        broken.check()


def test_check_catches_overlap_and_backprop_order() -> None:
    b0 = Bucket(0, 0, 128, 64)
    b1 = Bucket(1, 128, 256, 64)
    overlap = Buffer(
        "matrix",
        2,
        64,
        (b0,),
        (Placement("x", (64,), 0, 0, 64, 0), Placement("y", (64,), 0, 0, 64, 0)),
    )
    with pytest.raises(AssertionError, match="overlap"):
        overlap.check()
    forward_order = Buffer(
        "matrix",
        2,
        64,
        (b0, b1),
        (Placement("x", (64,), 1, 128, 192, 0), Placement("y", (64,), 0, 0, 64, 0)),
    )
    forward_order.check()  # y (registered last) is in bucket 0: backprop order
    wrong = Buffer("matrix", 2, 64, (b0, b1), forward_order.placements[::-1])
    with pytest.raises(AssertionError, match="backprop order"):
        wrong.check()


def test_check_with_specs_catches_shared_tied_bucket_and_order() -> None:
    specs = [spec("emb", 64, tied=True), spec("w", 64)]
    packed = whole_buffer([spec("emb", 64), spec("w", 64)], 2)
    with pytest.raises(AssertionError, match="tied param 'emb'"):
        packed.check(specs)
    buffer = whole_buffer(specs, 2)
    with pytest.raises(AssertionError, match="specs' order"):
        buffer.check(specs[::-1])


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dp_size": 0}, "dp_size must be an int >= 1"),
        ({"dp_size": 2.0}, "dp_size must be an int >= 1"),
        ({"align": 0}, "align must be an int >= 1"),
        ({"bucket_size": 0}, "bucket_size must be None"),
        ({"bucket_size": -5}, "bucket_size must be None"),
        ({"specs": [spec("w", 4), spec("w", 8)]}, "duplicate param name 'w'"),
        ({"specs": [spec("w", 4, -1)]}, "negative size"),
        ({"specs": [spec("w", 4, 0)]}, "no elements"),
        ({"specs": [ParamSpec("w", (4.0,), matrix=False)]}, "tuple of ints"),
        ({"specs": [ParamSpec("w", [4], matrix=False)]}, "tuple of ints"),
        ({"specs": [("w", (4,))]}, "expected ParamSpec"),
    ],
)
def test_bad_inputs_raise_value_error(kwargs: dict, message: str) -> None:
    specs = kwargs.pop("specs", [spec("w", 4)])
    args = {"dp_size": 2, **kwargs}
    dp = args.pop("dp_size")
    with pytest.raises(ValueError, match=message):
        whole_buffer(specs, dp, **args)


# ---------------------------------------------------------------- scale


def deepseek_like_specs() -> list[ParamSpec]:
    """~50k params: 61 layers x (257 experts x 3 matrices + attention, norms, small gates)."""
    specs = [spec("embed.weight", 129_280, 7168, tied=True)]
    for layer in range(61):
        p = f"layers.{layer}."
        specs += [
            spec(p + "attn.q_a.weight", 1536, 7168),
            spec(p + "attn.q_a_norm.weight", 1536),
            spec(p + "attn.q_b.weight", 24_576, 1536),
            spec(p + "attn.kv_a.weight", 576, 7168),
            spec(p + "attn.kv_a_norm.weight", 512),
            spec(p + "attn.kv_b.weight", 32_768, 512),
            spec(p + "attn.o.weight", 7168, 16_384),
            spec(p + "attn_norm.weight", 7168),
            spec(p + "ffn_norm.weight", 7168),
            spec(p + "router.weight", 256, 7168),
            spec(p + "router.bias", 256),
        ]
        specs += [spec(p + f"gate.{j}", 64 * (j + 1) + layer) for j in range(40)]
        for e in range(256):
            q = p + f"experts.{e}."
            specs += [spec(q + "w1", 2048, 7168), spec(q + "w3", 2048, 7168)]
            specs += [spec(q + "w2", 7168, 2048)]
        q = p + "shared_expert."
        specs += [
            spec(q + "w1", 2048, 7168),
            spec(q + "w3", 2048, 7168),
            spec(q + "w2", 7168, 2048),
        ]
    specs.append(spec("norm.weight", 7168))
    return specs


def test_fifty_thousand_params_at_dp_1024() -> None:
    specs = deepseek_like_specs()
    assert len(specs) >= 50_000
    t0 = time.perf_counter()
    buffer = whole_buffer(specs, 1024, bucket_size=2_000_000_000)
    print(f"planned {len(specs)} params at dp 1024 in {time.perf_counter() - t0:.3f} s")
    verify(buffer, specs, bucket_size=2_000_000_000)
    embed = buffer.placements[0]
    assert buffer.buckets[embed.bucket].shard_numel == round_up(129_280 * 7168, 64)
    experts = [p for p in buffer.placements if ".experts." in p.name]
    assert len({p.owner for p in experts}) == 1024
    assert math.isclose(
        sum(p.numel for p in buffer.placements) / buffer.numel, 1 - buffer.padding_fraction
    )
