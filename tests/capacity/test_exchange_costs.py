"""What an exchange plan costs ([Note: plan costs], [Note: alpha-beta prices]): ownership, the
fully sharded whole copies, every rank's all-to-alls against `planning.sync.exchange`, their
price at the busiest rank, and issue 45's done-when figures for the presets at dp 64-1024
against today's default plan and FSDP2-style equal shards. Pure: no torch."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from wholeshard.capacity._exchange import exchange_slots
from wholeshard.capacity.alpha_beta import FABRICS, Span, all_to_all_price, price
from wholeshard.capacity.choice import plan_and_choice
from wholeshard.capacity.costs import Mode, owned, plan_costs
from wholeshard.capacity.equal_shards import (
    equal_shard_collectives,
    matrix_shapes,
    megabatch_all_to_alls,
)
from wholeshard.capacity.presets import preset
from wholeshard.capacity.projection import (
    GPUS,
    comm_price,
    project,
    rank_ns_flops,
    step_comm_price,
)
from wholeshard.capacity.strategy_choice import figures, owners_era_default
from wholeshard.engine.config import DataParallelConfig
from wholeshard.planning import ParamSpec, plan_exactly
from wholeshard.planning._exchange import segments
from wholeshard.planning.sync import ELEMENT_BYTES, exchange, exchange_batches

FABRIC = FABRICS["nvlink4-ndr400"]
INTRA, INTER = FABRIC.intra, FABRIC.inter
ZERO = Mode(param_dtype="bfloat16", grad_reduce_dtype="float32")
SHARDED = dataclasses.replace(ZERO, reshard_after_forward=True)
GIB = 1024**3
H100 = GPUS["h100"][0]
REPO = Path(__file__).resolve().parents[2]


def _toy() -> list[ParamSpec]:
    """Three blocks of an expert stack, a matrix and a norm, between a tied embedding (alone in
    its bucket) and a final norm: stacks and matrices spanning shards at k of 2-8."""
    block = [("experts", (3, 20, 12), True), ("proj", (36, 12), True), ("ln", (12,), False)]
    inner = [ParamSpec(f"blocks.{i}.{n}", s, matrix=m) for i in range(3) for n, s, m in block]
    embedding = ParamSpec("wte", (40, 12), matrix=False, tied=True)
    return [embedding, *inner, ParamSpec("ln_f", (12,), matrix=False)]


@pytest.mark.parametrize("k", [2, 3, 8])
def test_owned_is_the_buffers_own_ownership(k: int) -> None:
    specs = _toy()
    plan = plan_exactly(specs, k, bucket_size=1, strategy="exchange", align=8)
    (buffer,) = plan.buffers
    mine = owned(plan, frozenset({"blocks.1.proj"}))
    for rank in range(k):
        pieces = list(buffer.owned(rank))
        matrix = sum(n for p, _, n in pieces if p.owners)
        adamw = [n for p, _, n in pieces if not p.owners]
        transposed = sum(n for p, _, n in pieces if p.name == "blocks.1.proj")
        got = mine[rank]
        assert (got.matrix, got.exchanged, got.transposed) == (matrix, matrix, transposed)
        assert (got.adamw, got.adamw_pieces) == (sum(adamw), len(adamw))


def test_fully_sharded_keeps_the_shards_and_whole_copies_of_owned_matrices() -> None:
    """In float32 the owned param copies are the masters and stay between steps; with separate
    masters (bf16) they live only through the step, and so in the peak, with the grads'."""
    specs = _toy()
    plan = plan_exactly(specs, 4, bucket_size=1, strategy="exchange", align=8)
    shards = sum(b.shard_numel for b in plan.buffers[0].buckets)
    costs = plan_costs(plan, specs, Mode(reshard_after_forward=True))
    bf16 = plan_costs(plan, specs, Mode(reshard_after_forward=True, param_dtype="bfloat16"))
    for rank, o in enumerate(owned(plan)):
        assert o.exchanged > 0
        assert costs.persistent[rank]["params"] == 4 * (shards + o.exchanged)
        assert bf16.persistent[rank]["params"] == 2 * shards
    assert plan_costs(plan, specs).persistent[0]["params"] == 4 * plan.numel  # ZeRO-1/2


@pytest.mark.parametrize("every", [None, 1, 2])
def test_every_ranks_all_to_alls_are_the_exchanges_of_its_batches(every: int | None) -> None:
    """`exchange_slots` groups the segments once; each record is what `exchange` says for the
    whole batch, and the step's collectives carry the rank's own."""
    specs = _toy()
    plan = plan_exactly(specs, 4, bucket_size=1, strategy="exchange", align=8)
    (buffer,) = plan.buffers
    mode = Mode(param_dtype="bfloat16", exchange_every=every)
    slots = exchange_slots(plan, mode)
    batches = exchange_batches(len(buffer.buckets), every)
    assert len(slots) == 2 * len(batches)
    segs = segments(buffer)
    for i, batch in enumerate(batches):
        mine = [s for s in segs if s.bucket in batch]
        for rank in range(4):
            assert slots[2 * i][rank] == exchange(mine, 4, rank, "float32", to_owners=True)
            assert slots[2 * i + 1][rank] == exchange(mine, 4, rank, "bfloat16", to_owners=False)
    costs = plan_costs(plan, specs, mode)
    a2a = [c for c in costs.collectives if c.op == "all_to_all"]
    assert a2a == [slot[costs.worst_rank] for slot in slots]
    assert exchange_slots(plan_exactly(specs, 1, bucket_size=1, strategy="exchange"), mode) == ()


def test_mode_reads_the_variants_exchange_every() -> None:
    class Variant:
        exchange_every = 3

    assert Mode.of(DataParallelConfig(), Variant()).exchange_every == 3  # type: ignore[arg-type]
    assert Mode.of(DataParallelConfig()).exchange_every is None
    with pytest.raises(ValueError, match="exchange_every must be None or an int >= 1"):
        Mode(exchange_every=0)


def test_an_all_to_all_costs_an_alpha_per_peer_and_its_larger_direction_on_one_nic() -> None:
    dense = Span.of(32, 1, 8)  # 4 nodes: 7 peers in the node, 24 beyond
    p = all_to_all_price(dense, 1000, 3000, 31, FABRIC)
    assert p.latency_s == pytest.approx(7 * INTRA.latency + 24 * INTER.latency)
    assert p.bandwidth_s == pytest.approx(3000 / INTER.bandwidth)  # one NIC, not the ring's 8
    few = all_to_all_price(dense, 5000, 0, 3, FABRIC)  # the fewest network hops 3 peers allow
    assert few.latency_s == pytest.approx(3 * INTRA.latency)
    assert few.bandwidth_s == pytest.approx(5000 / INTER.bandwidth)
    node = all_to_all_price(Span.of(8, 1, 8), 5000, 10, 7, FABRIC)
    assert node.latency_s == pytest.approx(7 * INTRA.latency)
    assert node.bandwidth_s == pytest.approx(5000 / INTRA.bandwidth)
    assert all_to_all_price(dense, 0, 0, 0, FABRIC).seconds == 0.0
    model_p = dataclasses.replace(FABRIC, nics=1)  # one NIC: the same price
    assert all_to_all_price(dense, 1000, 3000, 31, model_p) == p
    with pytest.raises(ValueError, match="all_to_all_price"):
        price("all_to_all", dense, 0, 0, FABRIC)


def test_the_projection_prices_each_all_to_all_at_its_busiest_rank() -> None:
    specs = preset("qwen3-30b-a3b")
    plan, _ = plan_and_choice(specs, 64, strategy="exchange")
    costs = plan_costs(plan, specs, ZERO)
    rest = [c for c in costs.collectives if c.op != "all_to_all"]
    base = comm_price(rest, 64, 64, FABRIC)
    slots = exchange_slots(plan, ZERO)
    busiest = [max(comm_price([c], 64, 64, FABRIC).seconds for c in slot) for slot in slots]
    worst = comm_price([c for c in costs.collectives if c.op == "all_to_all"], 64, 64, FABRIC)
    got = step_comm_price(costs, FABRIC)
    assert got.seconds == pytest.approx(base.seconds + sum(busiest))
    assert sum(busiest) >= worst.seconds  # the rank holding the most bytes is not the busiest
    assert project(costs, "nvlink4-ndr400", "h100").comm_s == pytest.approx(got.seconds)


PRESETS_AT_SCALE = ("llama3-8b", "llama3-70b", "qwen3-30b-a3b", "moe-256x")
DPS = (64, 256, 1024)
SCALES = [
    pytest.param(name, dp, id=f"{name}-dp{dp}", marks=[pytest.mark.slow] * (slow and dp < 1024))
    for name, slow in zip(PRESETS_AT_SCALE, (0, 0, 0, 1), strict=True)
    for dp in DPS
]
"""The presets at dp 64-1024; moe-256x (45K params, seconds a plan) only at 1024 but in soaks."""


@functools.cache
def _plans(name: str, dp: int):
    """The specs, the default plan before the exchange (`owners_era_default`: what issue 45
    measures against), the default plan (`wholeshard plan --preset P --dp N`: the exchange at
    these scales) and the owners plan."""
    specs = preset(name)
    today = owners_era_default(specs, dp)
    exchanged, _ = plan_and_choice(specs, dp)
    assert exchanged == plan_and_choice(specs, dp, strategy="exchange")[0]
    if today.strategy != "owners":
        return specs, today, exchanged, plan_and_choice(specs, dp, strategy="owners")[0]
    return specs, today, exchanged, today


@functools.cache
def _costs(name: str, dp: int, which: int, sharded: bool):
    """The costs of `_plans`' plan number `which` (1 today, 2 exchange, 3 owners)."""
    plans = _plans(name, dp)
    return plan_costs(plans[which], plans[0], SHARDED if sharded else ZERO)


@functools.cache
def _ns(name: str, dp: int, which: int) -> int:
    return max(rank_ns_flops(_plans(name, dp)[which]))


@pytest.mark.parametrize(("name", "dp"), SCALES)
def test_exchange_steps_faster_than_owner_buckets(name: str, dp: int) -> None:
    """Latency + bandwidth + the busiest rank's Newton-Schulz on nvlink4-ndr400, ZeRO-1/2
    ([Note: strategy figures])."""
    fast, slow = (figures(_costs(name, dp, which, False), FABRIC, "h100") for which in (2, 3))
    assert fast.step_s < slow.step_s, (fast, slow)


@functools.cache
def _done_when(name: str, dp: int, sharded: bool) -> dict[str, tuple[float, float]]:
    """Issue 45's figures of the exchange plan: (value, bound) each."""
    specs, _, exchanged, _ = _plans(name, dp)
    mode = SHARDED if sharded else ZERO
    new, old = _costs(name, dp, 2, sharded), _costs(name, dp, 1, sharded)
    equal = equal_shard_collectives(specs, dp, mode)
    floor = comm_price(equal, dp, dp, FABRIC)
    k = exchanged.shard_group_size
    rest = sum(c.bytes_sent for c in new.collectives if c.op != "all_to_all")
    slots = exchange_slots(exchanged, mode)
    busiest = rest + max(sum(s[r].bytes_sent for s in slots) for r in range(k))
    device = [max(c.device_bytes(r) for r in range(c.plan.shard_group_size)) for c in (new, old)]
    peak = (new.peak_transient, 1.1 * old.peak_transient)
    if (name, dp) == ("qwen3-30b-a3b", 64):
        peak = (peak[0], min(peak[1], 10 * GIB))
    return {
        "collectives": (len(new.collectives), 1.25 * len(equal)),
        "latency": (step_comm_price(new, FABRIC).latency_s, 1.5 * floor.latency_s),
        "bytes": (busiest, 1.1 * old.bytes_sent),
        "newton_schulz": (_ns(name, dp, 2), 1.1 * _ns(name, dp, 1)),
        "device_bytes": (device[0], 1.1 * device[1]),
        "peak": peak,
    }


FIGURES = ("collectives", "latency", "bytes", "newton_schulz", "device_bytes", "peak")
LAYER_GATHER = (
    "fully sharded, a gathered unit is a whole layer, where today's owner buckets gather "
    "40M-element pieces: llama3-70b's last layer's backward (855.6M elements: bf16 params and "
    "kept bf16 grads) runs beside the head's fp32 reduce-scatter (1.05B elements), 7.10 GiB "
    "against 5.87; moe-256x's layer is 11.3B elements, 85.7 GiB against 21.7; closing exchange "
    "buckets inside a layer at 40M meets the peak but issues 3.2-4x equal shards' collectives "
    "(moe-256x at dp 1024: 194x)"
)
MISSES = {
    (p, dp, "peak"): LAYER_GATHER
    for p, dps in (("llama3-70b", DPS), ("moe-256x", DPS))
    for dp in dps
}
"""Figures the exchange plan misses (issue 45's done-when), and why: reported, not loosened."""
CASES = [
    pytest.param(
        *scale.values,
        sharded,
        figure,
        id=f"{scale.id}-{'sharded' if sharded else 'zero'}-{figure}",
        marks=[*scale.marks]
        + [pytest.mark.xfail(strict=True, reason=MISSES.get((*scale.values, figure)))]
        * (sharded and (*scale.values, figure) in MISSES),
    )
    for scale in SCALES
    for sharded in (False, True)
    for figure in FIGURES
    if sharded or figure != "peak"
]


@pytest.mark.parametrize(("name", "dp", "sharded", "figure"), CASES)
def test_issue_45_done_when(name: str, dp: int, sharded: bool, figure: str) -> None:
    """The exchange plan (`wholeshard plan --preset P --dp N --strategy exchange`, its default
    bucket size) at most 1.25x equal shards' collectives and 1.5x their latency, 1.1x today's
    default plan's bytes (busiest rank), busiest Newton-Schulz, device bytes per rank and fully
    sharded peak (qwen3-30b-a3b at dp 64: under 10 GiB), on nvlink4-ndr400."""
    value, bound = _done_when(name, dp, sharded)[figure]
    assert value <= bound, (value, bound)


OVER_ITEM_2 = {("qwen3-30b-a3b", 256), ("qwen3-30b-a3b", 1024), ("moe-256x", 256),
               ("moe-256x", 1024)}  # fmt: skip
"""Where the fully sharded peak exceeds issue 45's design bound (docs/planning.md says which)."""


@pytest.mark.parametrize(("name", "dp"), SCALES)
def test_the_fully_sharded_peak_against_the_issues_design_bound(name: str, dp: int) -> None:
    """Item 2's bound, read as the largest unit's full params and grads plus the copies of the
    matrices a rank owns, holds but where one reduction in flight (a layer's backward beside
    the previous layer's fp32 reduce-scatter) exceeds it (`OVER_ITEM_2`)."""
    costs, exchanged = _costs(name, dp, 2, True), _plans(name, dp)[2]
    copy = ELEMENT_BYTES["float32"] + ELEMENT_BYTES["bfloat16"] * SHARDED.separate_masters
    bound = costs.transient_unit + max(o.exchanged for o in owned(exchanged)) * copy
    assert (costs.peak_transient > bound) == ((name, dp) in OVER_ITEM_2), (costs, bound)


def test_dion_style_megabatches_are_dense_all_to_alls_per_shape() -> None:
    """Per shape, ceil(count / dp) megabatches of dp padded matrices, each a dense all-to-all
    to the owners (grad dtype) and one back (param dtype), n - 1 peers each way."""
    specs = [ParamSpec(f"layers.{i}.w", (10, 6), matrix=True) for i in range(5)]
    specs += [ParamSpec("layers.0.experts", (7, 3, 6), matrix=True)]
    specs += [ParamSpec("norm.weight", (6,), matrix=False)]
    assert matrix_shapes(specs) == {(10, 6): 5, (3, 6): 7}
    got = megabatch_all_to_alls(specs, 4, ZERO)
    assert len(got) == 2 * (2 + 2)
    assert {(c.op, c.peers, c.ranks) for c in got} == {("all_to_all", 3, 4)}
    wide = [c for c in got if c.numel == 3 * 3 * 6]  # dp - 1 row shards of 3 padded rows
    assert len(wide) == 4 and {c.dtype for c in wide} == {"float32", "bfloat16"}
    assert all(c.received == c.numel for c in got)
    assert megabatch_all_to_alls(specs, 1) == []


def test_the_documented_exchange_model_is_what_the_code_prices() -> None:
    """docs/results/exchange-model.json (rendered into docs/planning.md) for llama3-8b: rerun
    `python tools/measure_exchange_model.py` when the costs or their prices change."""
    doc = json.loads((REPO / "docs" / "results" / "exchange-model.json").read_text())
    assert {(r["preset"], r["dp"]) for r in doc["rows"]} == {
        (p, dp) for p in PRESETS_AT_SCALE for dp in DPS
    }
    one_nic = dataclasses.replace(FABRIC, nics=1)
    for r in (r for r in doc["rows"] if r["preset"] == "llama3-8b"):
        dp = r["dp"]
        for which, key in ((1, "auto"), (2, "exchange")):
            costs, shown = _costs("llama3-8b", dp, which, False), r["designs"][key]
            assert shown["collectives"] == len(costs.collectives)
            assert shown["latency_s"] == step_comm_price(costs, FABRIC).latency_s
            assert shown["bandwidth_s"] == {
                "N": step_comm_price(costs, FABRIC).bandwidth_s,
                "P": step_comm_price(costs, one_nic).bandwidth_s,
            }
            assert shown["newton_schulz_s"] == _ns("llama3-8b", dp, which) / H100
        equal = equal_shard_collectives(preset("llama3-8b"), dp, ZERO)
        assert (
            r["designs"]["equal_shards"]["latency_s"] == comm_price(equal, dp, dp, FABRIC).latency_s
        )
