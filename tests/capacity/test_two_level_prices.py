"""Two-level groups priced ([Note: alpha-beta prices]): a "node" stage is n consecutive ranks, a
"cross" stage k / n ranks n apart with n of them on each node at once sharing its NICs; every
one-level price stays as it was. Pure and fast."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from wholeshard.capacity.alpha_beta import FABRICS, Price, Span, price
from wholeshard.capacity.costs import Collective, Mode, plan_costs, ring_bytes
from wholeshard.capacity.presets import preset
from wholeshard.capacity.projection import (
    collective_price,
    collective_seconds,
    comm_price,
    step_comm_price,
)
from wholeshard.planning import plan_for
from wholeshard.planning.plan import two_level
from wholeshard.planning.sync import two_level as two_stages

REPO = Path(__file__).resolve().parents[2]
FABRIC = FABRICS["nvlink4-ndr400"]
ONE_NIC = replace(FABRIC, nics=1)
NVLINK, NVLINK_HOP, NIC, NET_HOP = 450e9, 3.4e-6, 50e9, 9.6e-6
NUMEL = 1 << 26  # one bucket, fp32


def stages(op: str, k: int, node: int) -> tuple[Collective, Collective]:
    """The node and cross stages of `op` on one fp32 bucket over a shard group of `k`."""
    flat = Collective(op, k, NUMEL, "float32", "grads", "shard")
    out = two_stages([flat], node)
    return tuple(c for g in ("node", "cross") for c in out if c.group == g)  # type: ignore[return-value]


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
def test_node_and_cross_stages_by_hand(op: str) -> None:
    """k = 32 in nodes of 8: the node stage is a ring of 8 on NVLink; the cross stage a ring of
    4 nodes, all hops on the network, one NIC each on an 8-NIC node and 1/8 of one on a
    one-NIC node; the flat ring of 32 takes 31 hops at the node's ring bandwidth."""
    k, node, nbytes = 32, 8, NUMEL * 4
    within, across = stages(op, k, node)
    assert (within.ranks, within.numel, across.ranks, across.numel) == (8, NUMEL, 4, NUMEL // 8)
    for fabric in (FABRIC, ONE_NIC):
        got = collective_price(within, k, k, fabric, node)
        assert got.latency_s == pytest.approx(7 * NVLINK_HOP)
        assert got.bandwidth_s == pytest.approx(7 / 8 * nbytes / NVLINK)
    nic_share = {FABRIC: NIC, ONE_NIC: NIC / 8}
    for fabric, beta in nic_share.items():
        got = collective_price(across, k, k, fabric, node)
        assert got.latency_s == pytest.approx(3 * NET_HOP)
        assert got.bandwidth_s == pytest.approx(3 / 4 * nbytes / 8 / beta)
    flat = Collective(op, k, NUMEL, "float32", "grads", "shard")
    one = collective_price(flat, k, k, FABRIC, node)  # a one-level record ignores `node`
    assert one == collective_price(flat, k, k, FABRIC)
    assert one.latency_s == pytest.approx(28 * NVLINK_HOP + 3 * NET_HOP)
    assert one.bandwidth_s == pytest.approx(31 / 32 * nbytes / 370e9)


def test_cross_groups_share_the_nics_of_their_node() -> None:
    """min(nics, per_node x sharing) / sharing NICs a group: n = 8 cross groups of one rank a
    node get a NIC each of eight, 1/8 of one; nodes of 4 ranks on 8-GPU nodes put 2 ranks of
    each of 4 cross groups on a node: 2 NICs each."""
    assert Span.of(128, 8, 8, 8) == Span(128, 1, 128, 8)
    assert FABRIC.beta(Span.of(128, 8, 8, 8)) == NIC
    assert ONE_NIC.beta(Span.of(128, 8, 8, 8)) == NIC / 8
    assert FABRIC.beta(Span.of(256, 4, 8, 4)) == 2 * NIC
    four = Collective("reduce_scatter", 256, NUMEL, "float32", "grads", "cross")
    sent = ring_bytes("reduce_scatter", NUMEL * 4, 256)
    assert collective_price(four, 1024, 1024, FABRIC, 4).bandwidth_s == pytest.approx(
        sent / (2 * NIC)
    )


def test_one_level_prices_are_unchanged() -> None:
    """Replica groups are priced alone, as before (they do not yet count their sharing); a
    group that runs alone has sharing 1 and the beta it had."""
    assert Span.of(16, 8, 8) == Span(16, 1, 16, 1)
    replicas = Collective("all_reduce", 128, NUMEL, "float32", "grads", "replica")
    sent = ring_bytes("all_reduce", NUMEL * 4, 128)
    alone = price("all_reduce", Span(128, 1, 128), sent, NUMEL * 4, FABRIC)
    assert collective_price(replicas, 1024, 8, FABRIC, 8) == alone
    assert collective_price(replicas, 1024, 8, FABRIC) == alone


@pytest.fixture(scope="module")
def llama_1024() -> dict[int, object]:
    """llama3-8b at dp 1024, strategy exchange: its costs in one level and in two of 8."""
    specs = preset("llama3-8b")
    plan = plan_for(specs, 1024, strategy="exchange")
    mode = Mode(param_dtype="bfloat16")
    return {n: plan_costs(two_level(plan, n), specs, mode) for n in (1, 8)}


def test_two_levels_cut_the_latency_of_every_ring_at_dp_1024(llama_1024: dict) -> None:
    """A reduce-scatter over 1024 ranks takes 1023 hops (127 across nodes); in two levels of 8,
    7 on NVLink and then 127 across nodes. The exchange's all-to-alls and the step's
    all-reduces are the same records either way."""
    one, two = llama_1024[1], llama_1024[8]
    assert two.plan.node_size == 8 and one.plan.node_size == 1
    flat = next(c for c in one.collectives if c.op == "reduce_scatter")
    within, across = stages("reduce_scatter", 1024, 8)
    assert collective_price(flat, 1024, 1024, FABRIC).latency_s == pytest.approx(
        896 * NVLINK_HOP + 127 * NET_HOP
    )
    staged = comm_price([within, across], 1024, 1024, FABRIC, 8)
    assert staged.latency_s == pytest.approx(7 * NVLINK_HOP + 127 * NET_HOP)
    rings = {"reduce_scatter", "all_gather"}
    assert [c for c in two.collectives if c.op not in rings] == [
        c for c in one.collectives if c.op not in rings
    ]
    assert sum(c.op in rings for c in two.collectives) == 2 * sum(
        c.op in rings for c in one.collectives
    )
    # the step's price reads the plan's node size, as `collective_seconds` does
    rest = [c for c in two.collectives if c.op != "all_to_all"]
    shards = comm_price(rest, 1024, 1024, FABRIC, 8)
    assert shards.seconds == pytest.approx(
        sum(collective_seconds(c, two.plan, FABRIC) for c in rest)
    )
    assert step_comm_price(two, FABRIC).latency_s < step_comm_price(one, FABRIC).latency_s / 3


def test_bandwidth_of_two_levels_on_eight_nics_and_on_one(llama_1024: dict) -> None:
    """What the model gives at dp 1024: on 8 NICs a node the flat ring already leaves through
    all eight (370 GB/s), so the node stage's NVLink time makes two levels cost more
    bandwidth; on one NIC the cross stages move the flat ring's bytes through it (to within
    1023/1024 vs 127/128 of a ring), and the node stage's NVLink time comes on top: about 9%
    more."""
    one, two = llama_1024[1], llama_1024[8]
    eight = {n: step_comm_price(c, FABRIC) for n, c in llama_1024.items()}
    assert eight[8].bandwidth_s > eight[1].bandwidth_s
    single: dict[int, Price] = {n: step_comm_price(c, ONE_NIC) for n, c in llama_1024.items()}
    node_stage = comm_price([c for c in two.collectives if c.group == "node"], 1024, 1024,
                            ONE_NIC, 8)  # fmt: skip
    assert single[8].bandwidth_s - node_stage.bandwidth_s == pytest.approx(
        single[1].bandwidth_s, rel=0.01
    )
    assert single[1].bandwidth_s < single[8].bandwidth_s < 1.1 * single[1].bandwidth_s
    assert single[8].latency_s == eight[8].latency_s  # the latency term is the NICs' alone
    # Each rank sends what the flat ring sends: 7/8 S within the node + 127/128 x S/8 across
    # nodes = 1023/1024 S; only where the bytes go differs.
    assert one.bytes_sent == two.bytes_sent


def test_the_documented_two_level_table_is_what_the_code_prices() -> None:
    """docs/results/two-level.json (rendered into docs/planning.md) for llama3-8b: rerun
    `python tools/measure_two_level.py` when the costs or their prices change."""
    doc = json.loads((REPO / "docs" / "results" / "two-level.json").read_text())
    assert {(r["preset"], r["dp"]) for r in doc["rows"]} == {
        (p, dp) for p in ("llama3-8b", "llama3-70b", "qwen3-30b-a3b", "moe-256x")
        for dp in (64, 256, 1024)
    }  # fmt: skip
    specs, mode = preset("llama3-8b"), Mode(param_dtype="bfloat16")
    for r in (r for r in doc["rows"] if r["preset"] == "llama3-8b"):
        for node, shown in r["levels"].items():
            plan = plan_for(specs, r["dp"], node_size=None if node == "1" else int(node))
            costs = plan_costs(plan, specs, mode)
            assert (shown["node_size"], shown["strategy"]) == (plan.node_size, plan.strategy)
            assert shown["node_size"] == int(node)
            assert shown["collectives"] == len(costs.collectives)
            assert shown["latency_s"] == step_comm_price(costs, FABRIC).latency_s
            assert shown["bandwidth_s"] == {
                "N": step_comm_price(costs, FABRIC).bandwidth_s,
                "P": step_comm_price(costs, ONE_NIC).bandwidth_s,
            }
