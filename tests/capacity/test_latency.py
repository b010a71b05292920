"""`wholeshard.capacity.alpha_beta`: each collective kind priced by the algorithm NCCL runs it
with ([Note: alpha-beta prices]); the projection's latency and bandwidth terms; the FSDP2-style
equal-shard baseline; and docs/planning.md's latency table against the code. Pure and fast."""

from __future__ import annotations

import importlib
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from wholeshard.capacity.alpha_beta import ALGORITHMS, FABRICS, Span, price
from wholeshard.capacity.choice import plan_and_choice
from wholeshard.capacity.costs import Collective, Mode, plan_costs, ring_bytes
from wholeshard.capacity.equal_shards import ROOT, equal_shard_collectives, padded_numel, unit_of
from wholeshard.capacity.presets import preset
from wholeshard.capacity.projection import collective_price, comm_price, exchange_price, project
from wholeshard.planning import ParamSpec

FABRIC = FABRICS["nvlink4-ndr400"]
INTRA, INTER = FABRIC.intra, FABRIC.inter
NODE_RING = 370e9
"""A ring over whole DGX H100 nodes: eight NDR NICs a node (8 x 50 GB/s) at NCCL's Hopper cap."""
REPO = Path(__file__).resolve().parents[2]


def test_spans_place_consecutive_and_strided_groups_on_nodes() -> None:
    assert Span.of(8, 1, 8) == Span(8, 8, 1)
    assert Span.of(32, 1, 8) == Span(32, 8, 4)
    assert Span.of(4, 2, 8) == Span(4, 4, 1)  # replicas 2 apart: one node
    assert Span.of(16, 8, 8) == Span(16, 1, 16)  # replicas a node apart: one per node
    assert Span.of(3, 1, 8) == Span(3, 3, 1)


def test_a_group_across_nodes_sends_through_every_nic_its_ranks_reach() -> None:
    """NCCL's tuning model: a ring's channels leave a node through a NIC each, so a flat group
    of whole nodes gets the node's eight NICs (at the Hopper cap), a group with one rank per
    node one NIC, a group inside a node NVLink; the latency term is the same either way."""
    assert INTRA.bandwidth == 450e9 and INTER.bandwidth == 50e9 and FABRIC.nics == 8
    dp, numel = 1024, 1 << 28
    sent = ring_bytes("reduce_scatter", numel * 4, dp)

    def bandwidth(c: Collective, k: int) -> float:
        return collective_price(c, dp, k, FABRIC).bandwidth_s

    flat = Collective("reduce_scatter", dp, numel, "float32", "grads", "dp")
    assert bandwidth(flat, dp) == pytest.approx(sent / 370e9)
    replicas = Collective("reduce_scatter", dp // 8, numel, "float32", "grads", "replica")
    ring = ring_bytes("reduce_scatter", numel * 4, dp // 8)  # 128 ranks a node apart: 1 a node
    assert bandwidth(replicas, 8) == pytest.approx(ring / 50e9)
    shard = Collective("reduce_scatter", 8, numel, "float32", "grads", "shard")
    assert bandwidth(shard, 8) == pytest.approx(ring_bytes("reduce_scatter", numel * 4, 8) / 450e9)
    # Replicas 4 apart: two ranks a node, two NICs; a fabric of one NIC a node: one NIC always.
    assert FABRIC.beta(Span.of(256, 4, 8)) == 2 * 50e9
    one_nic = replace(FABRIC, nics=1)
    assert one_nic.beta(Span.of(dp, 1, 8)) == one_nic.beta(Span.of(128, 8, 8)) == 50e9
    assert FABRIC.beta(Span.of(8, 1, 8)) == one_nic.beta(Span.of(8, 1, 8)) == 450e9
    flat_one_nic = price("reduce_scatter", Span.of(dp, 1, 8), sent, numel * 4, one_nic)
    assert flat_one_nic.latency_s == collective_price(flat, dp, dp, FABRIC).latency_s
    # Below the cap the NICs decide; a PCIe node's ring is its PCIe link's.
    assert FABRICS["nvlink3-hdr200"].beta(Span.of(64, 1, 8)) == 8 * 25e9
    assert FABRICS["pcie4-eth100"].beta(Span.of(64, 1, 8)) == 32e9


def test_in_one_node_every_kind_takes_its_algorithms_hops() -> None:
    span, sent = Span.of(8, 1, 8), 7000
    for op, hops in [("reduce_scatter", 7), ("all_gather", 7), ("reduce", 7), ("broadcast", 7),
                     ("reduce_coalesced", 7), ("broadcast_coalesced", 7)]:  # fmt: skip
        p = price(op, span, sent, 8000, FABRIC)
        assert p.latency_s == pytest.approx(hops * INTRA.latency), op
        assert p.bandwidth_s == pytest.approx(sent / INTRA.bandwidth), op
    payload = 1 << 30  # a ring: 2 (n - 1) hops, 2 (n - 1) / n of the payload sent
    ring = price("all_reduce", span, ring_bytes("all_reduce", payload, 8), payload, FABRIC)
    assert ring.latency_s == pytest.approx(14 * INTRA.latency)
    assert ring.bandwidth_s == pytest.approx(2 * 7 / 8 * payload / INTRA.bandwidth)
    assert price("all_reduce", Span.of(1, 1, 8), 0, payload, FABRIC).seconds == 0.0
    assert set(ALGORITHMS) >= {"reduce_scatter", "all_gather", "reduce", "broadcast",
                               "all_reduce", "reduce_coalesced", "broadcast_coalesced"}  # fmt: skip
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        price("gossip", span, 0, 0, FABRIC)


def test_hops_between_nodes_cost_the_inter_node_alpha() -> None:
    span, sent = Span.of(32, 1, 8), 3100  # 4 nodes of 8
    chain = price("broadcast", span, sent, 3200, FABRIC)
    assert chain.latency_s == pytest.approx(28 * INTRA.latency + 3 * INTER.latency)
    assert chain.bandwidth_s == pytest.approx(sent / NODE_RING)
    group = price("broadcast_coalesced", span, sent, 3200, FABRIC)  # the chains run at once
    assert group.latency_s == pytest.approx(chain.latency_s)
    # A small all-reduce takes the tree: 2 ((8 - 1) + log2 4) hops, twice the payload sent.
    tree = price("all_reduce", span, ring_bytes("all_reduce", 8, 32), 8, FABRIC)
    assert tree.latency_s == pytest.approx(2 * (7 * INTRA.latency + 2 * INTER.latency))
    assert tree.bandwidth_s == pytest.approx(16 / NODE_RING)
    # A large one the ring: 62 hops, 6 of them between nodes.
    big = 1 << 32
    ring = price("all_reduce", span, ring_bytes("all_reduce", big, 32), big, FABRIC)
    assert ring.latency_s == pytest.approx(56 * INTRA.latency + 6 * INTER.latency)


def test_the_latency_term_grows_with_the_count_and_the_ranks() -> None:
    c = Collective("reduce", 1, 1024, "float32", "grads", "shard")
    last = 0.0
    for n in (8, 64, 256, 1024):
        one = collective_price(Collective(c.op, n, c.numel, c.dtype, c.what, "dp"), n, n, FABRIC)
        nodes = math.ceil(n / 8)
        assert one.latency_s == pytest.approx((n - nodes) * INTRA.latency
                                              + (nodes - 1) * INTER.latency)  # fmt: skip
        assert one.latency_s > last
        last = one.latency_s
        many = comm_price([Collective(c.op, n, c.numel, c.dtype, c.what, "dp")] * 90, n, n, FABRIC)
        assert many.latency_s == pytest.approx(90 * one.latency_s)
        assert many.bandwidth_s == pytest.approx(90 * one.bandwidth_s)


def test_an_owner_buckets_group_costs_a_chains_latency_once() -> None:
    """An owner bucket's reduces, one per owner, issued as one group: one chain's hops, where
    the reduces one after the other took one chain's hops each."""
    n, bucket = 1024, 1 << 28
    sent = ring_bytes("reduce_coalesced", bucket, n)
    one = price("reduce_coalesced", Span.of(n, 1, 8), sent, bucket, FABRIC)
    assert one.latency_s == pytest.approx(896 * INTRA.latency + 127 * INTER.latency)
    assert one.bandwidth_s == pytest.approx(sent / NODE_RING)
    owners = 3
    each = price("reduce", Span.of(n, 1, 8), sent // owners, bucket // owners, FABRIC)
    assert owners * each.latency_s == pytest.approx(owners * one.latency_s)
    assert owners * each.bandwidth_s == pytest.approx(one.bandwidth_s, rel=1e-6)


def test_the_projection_splits_communication_into_latency_and_bandwidth() -> None:
    specs = preset("llama3-8b")
    latencies = []
    for dp in (64, 256, 1024):
        plan, _ = plan_and_choice(specs, dp)
        costs = plan_costs(plan, specs, Mode(param_dtype="bfloat16"))
        p = project(costs, "nvlink4-ndr400", "h100")
        rest = [c for c in costs.collectives if c.op != "all_to_all"]  # each a2a: its busiest
        prices = [collective_price(c, dp, plan.shard_group_size, FABRIC) for c in rest]
        prices.append(exchange_price(plan, costs.mode, FABRIC))
        assert p.latency_s == pytest.approx(sum(q.latency_s for q in prices))
        assert p.bandwidth_s == pytest.approx(sum(q.bandwidth_s for q in prices))
        assert p.comm_s == p.latency_s + p.bandwidth_s
        assert (p.collectives, p.bytes_sent) == (len(costs.collectives), costs.bytes_sent)
        figures = p.as_dict()
        assert {"comm_s", "newton_schulz_s", "elementwise_s", "step_s"} <= set(figures)
        assert figures["latency_s"] == p.latency_s and figures["collectives"] == p.collectives
        assert f"latency {p.latency_s:.3g} s + bandwidth {p.bandwidth_s:.3g} s" in p.describe()
        latencies.append(p.latency_s)
    assert latencies == sorted(latencies)  # more hops per collective as dp grows


def test_equal_shards_pad_dim_0_and_sync_each_block_once_per_step() -> None:
    specs = [ParamSpec("emb.weight", (7, 4), matrix=False)]
    for i in range(2):
        specs += [ParamSpec(f"layers.{i}.w", (10, 4), matrix=True),
                  ParamSpec(f"layers.{i}.b", (10,), matrix=False)]  # fmt: skip
    specs.append(ParamSpec("norm.weight", (4,), matrix=False))
    assert [unit_of(s.name) for s in specs] == [ROOT, "layers.0", "layers.0", "layers.1",
                                                "layers.1", ROOT]  # fmt: skip
    assert padded_numel((10, 4), 4) == 48 and padded_numel((7,), 8) == 8
    out = equal_shard_collectives(specs, 4, Mode())
    root, block = 8 * 4 + 4, 48 + 12
    assert [(c.op, c.numel, c.ranks) for c in out] == [
        ("reduce_scatter", root, 4), ("all_gather", root, 4),
        ("reduce_scatter", block, 4), ("all_gather", block, 4),
        ("reduce_scatter", block, 4), ("all_gather", block, 4),
        ("all_reduce", 1, 4),
    ]  # fmt: skip
    resharded = equal_shard_collectives(specs, 4, Mode(reshard_after_forward=True))
    assert [c.op for c in resharded].count("all_gather") == 1 + 2 * 2
    assert equal_shard_collectives(specs, 1) == []


def test_the_documented_latency_table_is_what_the_code_prices() -> None:
    """docs/results/latency.json (rendered into docs/planning.md) for the fast presets: rerun
    `python tools/measure_latency.py` when the collectives or their prices change."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        measure = importlib.import_module("measure_latency")
    finally:
        sys.path.remove(str(REPO / "tools"))
    doc = json.loads((REPO / "docs" / "results" / "latency.json").read_text())
    rows = {(r["preset"], r["dp"]): r for r in doc["rows"]}
    assert set(rows) == {(p, dp) for p in measure.PRESET_NAMES for dp in measure.DPS}
    for name in ("llama3-8b", "llama3-70b"):
        specs = preset(name)
        for dp in measure.DPS:
            got = measure.row(name, specs, dp, doc["fabric"], doc["gpu"])
            assert got == rows[(name, dp)], (name, dp)
