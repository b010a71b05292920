"""`wholeshard.capacity.costs`: what a plan costs each rank, from the plan alone. Pure and fast:
invariants over presets, the plan's own ownership API as the reference, and the traffic
counter's arithmetic (`tests/engine/test_plan_agrees.py` checks the figures against real runs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import wholeshard.bench.baselines  # noqa: F401  (registers the legacy baselines' layouts)
from wholeshard.bench import traffic
from wholeshard.capacity._lifetimes import _events, kept_units
from wholeshard.capacity.costs import (
    ELEMENT_BYTES,
    OPS,
    Mode,
    dtype_name,
    fully_sharded,
    owned,
    plan_costs,
    ring_bytes,
    storage_units,
)
from wholeshard.capacity.presets import preset
from wholeshard.capacity.projection import (
    FABRICS,
    GPUS,
    collective_seconds,
    ns_flops,
    project,
    rank_ns_flops,
)
from wholeshard.planning import ParamSpec, default_bucket_size, plan_exactly, plan_for
from wholeshard.planning.layouts import laid_out, layout_named

CASES = [  # (preset, dp, shard group size)
    ("gpt2-small", 1, None),
    ("gpt2-small", 8, None),
    ("gpt2-small", 8, 1),
    ("gpt2-small", 12, 4),
    ("llama3-8b", 64, 8),
    ("qwen3-30b-a3b", 64, 16),
    ("llama3-8b", 64, None),  # owner buckets
]
MODES = [
    Mode(),
    Mode(param_dtype="bfloat16", grad_reduce_dtype="bfloat16", overlap_grad_reduce=True),
    Mode(reshard_after_forward=True, param_dtype="bfloat16"),
    Mode(reshard_after_forward=True, overlap_grad_reduce=True, overlap_param_gather=True),
    Mode(clip_grad_norm=False),
]
LAID_OUT = [None] * (len(MODES) - 1) + ["shard_broadcasts"]
"""The layout each mode's plan takes in `test_collectives_per_step`: the last, the bench's
broadcast baseline (`wholeshard.bench.baselines`), whose registered description costs price."""


def _plan(name: str, dp: int, k: int | None):
    specs = preset(name)
    bucket_size = default_bucket_size(sum(s.numel for s in specs), dp)
    return plan_exactly(specs, dp, bucket_size=bucket_size, shard_group_size=k), specs


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-dp{c[1]}-k{c[2]}")
def planned(request):
    return _plan(*request.param)


def test_ring_bytes_is_the_traffic_counters_arithmetic() -> None:
    """One table of bytes per collective: the traffic counter's, which charges real runs."""
    c10d = {"all_reduce": "allreduce_", "broadcast": "broadcast_", "reduce": "reduce_"}
    # a coalesced group of reduces or broadcasts sends what one of its total size does
    c10d |= {"reduce_coalesced": "reduce_", "broadcast_coalesced": "broadcast_"}
    for op in OPS:
        for ranks in (1, 2, 3, 8, 1024):
            for nbytes in (0, 4, 1000, 12_345_679):
                t = torch.empty(nbytes, dtype=torch.uint8, device="meta")
                if op == "reduce_scatter":
                    args, name = (t.new_empty(nbytes // ranks), t), "_reduce_scatter_base"
                elif op == "all_gather":
                    args, name = (t, t.new_empty(nbytes // ranks)), "_allgather_base"
                elif op == "all_to_all":  # the exchange sends nothing to itself
                    if ranks == 1:
                        continue
                    splits = [0, nbytes] + [0] * (ranks - 2)
                    args, name = (t, t, None, splits, splits), "alltoall_base"
                else:
                    args, name = ([t],), c10d[op]
                expected = traffic.bytes_sent("c10d", name, args, ranks, 0)
                assert ring_bytes(op, nbytes, ranks) == expected, (op, ranks, nbytes)
    with pytest.raises(ValueError, match="unknown collective"):
        ring_bytes("all_to_all_v", 8, 2)


def test_dtypes_are_read_from_names_or_torch_dtypes() -> None:
    assert Mode(param_dtype="bf16").param_dtype == "bfloat16"
    assert Mode(param_dtype=torch.bfloat16, grad_reduce_dtype=torch.float16).grad_reduce_dtype == (
        "float16"
    )
    assert dtype_name(torch.float32) == "float32" and ELEMENT_BYTES[dtype_name("half")] == 2
    with pytest.raises(ValueError, match="unknown dtype"):
        Mode(param_dtype="int8")


def test_owned_matches_the_plans_own_ownership(planned) -> None:
    """`owned` deals in one pass what `Buffer.owned(rank)` yields rank by rank."""
    plan, _ = planned
    mine = owned(plan, frozenset({"transformer.h.0.attn.c_attn.weight"}))
    for rank in range(plan.shard_group_size):
        muon = adamw = pieces = transposed = 0
        for buffer in plan.buffers:
            for p, _, length in buffer.owned(rank):
                if buffer.kind == "adamw":
                    adamw, pieces = adamw + length, pieces + 1
                else:
                    muon += length
                    transposed += length if p.name == "transformer.h.0.attn.c_attn.weight" else 0
        got = mine[rank]
        assert (got.matrix, got.adamw, got.adamw_pieces, got.transposed) == (
            muon,
            adamw,
            pieces,
            transposed,
        )


@pytest.mark.parametrize("mode", MODES, ids=range(len(MODES)))
def test_persistent_bytes_add_up(planned, mode: Mode) -> None:
    plan, specs = planned
    costs = plan_costs(plan, specs, mode)
    pb, gb = ELEMENT_BYTES[mode.param_dtype], ELEMENT_BYTES[mode.grad_reduce_dtype]
    k = plan.shard_group_size
    sharded = mode.reshard_after_forward and plan.dp_size > 1 and k > 1
    kept = plan.numel // k if sharded else plan.numel
    muon = sum(s.numel for s in specs if s.matrix)
    adamw = sum(s.numel for s in specs if not s.matrix)
    assert len(costs.persistent) == k
    for p in costs.persistent:
        assert (p["params"], p["grads"]) == (kept * pb, kept * gb)
        assert p["total"] == sum(v for key, v in p.items() if key != "total")
    total = {key: sum(p[key] for p in costs.persistent) for key in costs.persistent[0]}
    assert total["masters"] == (4 * (muon + adamw) if pb != 4 else 0)
    assert total["master_grads"] == (4 * (muon + adamw) if gb != 4 else 0)
    pieces = sum(o.adamw_pieces for o in owned(plan))
    assert pieces >= sum(not s.matrix for s in specs)
    assert total["optimizer_state"] == 4 * muon + 8 * adamw + 4 * pieces
    assert costs.worst_rank == max(range(k), key=lambda r: (costs.persistent[r]["total"], -r))


@pytest.mark.parametrize("grads", ["float32", "bfloat16"])
def test_offloaded_masters_and_state_are_host_bytes(planned, grads: str) -> None:
    """Offloaded, masters and state but the 0-d AdamW steps are host bytes, master grads made
    only for a unit's update; without offload every byte is on the device."""
    plan, specs = planned
    mode = Mode(param_dtype="bfloat16", grad_reduce_dtype=grads)
    kept = plan_costs(plan, specs, mode)
    offloaded = plan_costs(plan, specs, dataclasses.replace(mode, offload_state=True))
    for r, (p, q) in enumerate(zip(kept.persistent, offloaded.persistent, strict=True)):
        assert (kept.device_bytes(r), kept.host_bytes(r)) == (p["total"], 0)
        steps = 4 * owned(plan)[r].adamw_pieces
        assert offloaded.host_bytes(r) == p["masters"] + p["optimizer_state"] - steps > 0
        assert q["master_grads"] == 0 and (p["master_grads"] > 0) == (grads == "bfloat16")
        assert offloaded.device_bytes(r) == p["total"] - p["master_grads"] - offloaded.host_bytes(r)


def test_transposed_weights_keep_fp32_masters() -> None:
    plan, specs = _plan("gpt2-small", 4, None)
    names = {s.name for s in specs if s.name.endswith("c_attn.weight")}
    costs = plan_costs(plan, specs, Mode(transposed=frozenset(names)))
    expected = 4 * sum(s.numel for s in specs if s.name in names)
    assert sum(p["masters"] for p in costs.persistent) == expected
    assert sum(p["master_grads"] for p in costs.persistent) == expected


@pytest.mark.parametrize(
    ("mode", "layout"), zip(MODES, LAID_OUT, strict=True), ids=range(len(MODES))
)
def test_collectives_per_step(planned, mode: Mode, layout: str | None) -> None:
    plan, specs = planned
    if layout is not None:
        plan = laid_out(layout_named(layout), plan, specs, None)
    costs = plan_costs(plan, specs, mode)
    dp, k = plan.dp_size, plan.shard_group_size
    counts = costs.counts()
    if dp == 1:
        assert counts == {} and costs.bytes_sent == 0
        return
    units = storage_units(plan, specs)
    buckets = sum(len(u.buckets) for u in units)
    owner_buckets = sum(b.owners for u in units for b in u.buckets)
    assert counts.get("reduce_coalesced", 0) == owner_buckets
    assert counts.get("reduce_scatter", 0) == buckets - owner_buckets
    replicas = buckets if dp > k else 0
    ran = fully_sharded(plan, mode) and mode.overlap_grad_reduce  # the modules-run flags
    check = 1 + (mode.clip_grad_norm and k > 1) + ran
    assert counts["all_reduce"] == replicas + check
    times = [0] * len(units)  # how often each unit's params are synced
    if k > 1:
        kept = kept_units(units) if mode.reshard_after_forward else set(range(len(units)))
        times = [1 if u.index in kept else 2 for u in units]
    gathers = sum(t * len(u.buckets) for t, u in zip(times, units, strict=True))
    owner_gathers = sum(
        t * sum(b.owners for b in u.buckets) for t, u in zip(times, units, strict=True)
    )
    assert counts.get("broadcast_coalesced", 0) == owner_gathers
    op = "all_gather" if layout is None else "broadcast"
    assert counts.get(op, 0) == (gathers - owner_gathers) * (1 if op == "all_gather" else k)
    # bytes, independently: each bucket's reduce-scatter and each sync move (k-1)/k of it
    pb, gb = ELEMENT_BYTES[mode.param_dtype], ELEMENT_BYTES[mode.grad_reduce_dtype]
    expected = 0.0
    for t, u in zip(times, units, strict=True):
        expected += (k - 1) / k * u.numel * (gb + t * pb)
        if dp > k:
            expected += 2 * (dp // k - 1) / (dp // k) * u.shard_numel * gb
    expected += 2 * (dp - 1) / dp * 8 * (4 + len(specs))
    expected += 2 * (dp - 1) / dp * 4 * len(units) if ran else 0
    if mode.clip_grad_norm and k > 1:
        expected += 2 * (k - 1) / k * 4
    # each collective's bytes are rounded to an integer
    assert abs(costs.bytes_sent - expected) <= len(costs.collectives)


def test_peak_transient_is_zero_unless_fully_sharded(planned) -> None:
    plan, specs = planned
    for mode in MODES:
        costs = plan_costs(plan, specs, mode)
        sharded = mode.reshard_after_forward and plan.dp_size > 1 and plan.shard_group_size > 1
        if not sharded:
            assert costs.peak_transient == costs.transient_unit == 0
            continue
        units = storage_units(plan, specs)
        pb, gb = ELEMENT_BYTES[mode.param_dtype], ELEMENT_BYTES[mode.grad_reduce_dtype]
        assert costs.transient_unit == max(u.numel for u in units) * (pb + gb)
        # a unit's params are released before its kept grads get full storage ([Note: kept
        # gradients] in the engine's `_kept_grads`): the largest unit may never be whole
        largest = max(u.numel for u in units)
        assert largest * max(pb, gb) <= costs.peak_transient <= plan.numel * (pb + gb)
        if not mode.overlap_grad_reduce:  # every full grad lives until the step
            assert costs.peak_transient >= plan.numel * gb


def test_overlapped_reductions_free_grads_during_backward() -> None:
    """A stack of Muon layers between an embedding and a head, each in buckets of their own:
    buckets complete in reduce order, so overlapped reductions free each bucket's grads while
    backward runs (one reduction in flight), where serial ones keep every grad to the step."""
    specs = [ParamSpec("emb.weight", (64, 64), matrix=False)]
    specs += [ParamSpec(f"layers.{i}.weight", (64, 64), matrix=True) for i in range(8)]
    specs.append(ParamSpec("head.weight", (64, 64), matrix=False))
    plan = plan_exactly(specs, 2, bucket_size=4096)  # two layers a bucket (k times the widest)
    fsdp = Mode(reshard_after_forward=True, overlap_grad_reduce=False)
    serial = plan_costs(plan, specs, fsdp).peak_transient
    overlapped = plan_costs(plan, specs, Mode(reshard_after_forward=True, overlap_grad_reduce=True))
    assert serial >= plan.numel * 4  # every grad until the step
    assert overlapped.peak_transient <= 2 * overlapped.transient_unit < serial


def test_the_module_model_nests_modules_by_name() -> None:
    names = ["pos", "emb.weight", "blocks.0.scale", "blocks.0.fc.weight", "blocks.0.fc.bias",
             "blocks.1.fc.weight", "head.weight"]  # fmt: skip
    events = _events([ParamSpec(n, (2, 2), matrix=True) for n in names])
    assert events == [
        ("pre", ""),
        ("pre", "emb"),
        ("post", "emb"),
        ("pre", "blocks.0"),
        ("pre", "blocks.0.fc"),
        ("post", "blocks.0.fc"),
        ("post", "blocks.0"),
        ("pre", "blocks.1.fc"),
        ("post", "blocks.1.fc"),
        ("pre", "head"),
        ("post", "head"),
        ("post", ""),
    ]


def test_storage_units_cover_every_bucket_in_reduce_order(planned) -> None:
    plan, specs = planned
    units = storage_units(plan, specs)
    assert [u.index for u in units] == list(range(len(units)))
    assert specs[-1].name in units[0].names  # the last registered param is reduced first
    covered = sorted((b.start, b.end, u.kind) for u in units for b in u.buckets)
    every = sorted((b.start, b.end, buf.kind) for buf in plan.buffers for b in buf.buckets)
    assert covered == every
    assert sorted(n for u in units for n in u.names) == sorted(s.name for s in specs)


def test_a_layouts_own_buffer_kind_is_refused() -> None:
    specs = preset("gpt2-small")
    plan = plan_for(specs, 4, layout="ping_pong", bucket_size=1 << 20)
    with pytest.raises(ValueError, match="costs of a 'unaligned' buffer .* are not modelled"):
        plan_costs(plan, specs)


# -- the step projection ----------------------------------------------------------------------


def test_ns_flops_counts_the_three_products_of_five_iterations() -> None:
    # (m, n), m <= n: X X^T 2 m^2 n, G G 2 m^3, G X 2 m^2 n per iteration; a stack per matrix.
    assert ns_flops((16, 64)) == ns_flops((64, 16)) == 5 * (4 * 16 * 16 * 64 + 2 * 16**3)
    assert ns_flops((3, 48, 32)) == 3 * 5 * (4 * 32 * 32 * 48 + 2 * 32**3)
    assert ns_flops((64,)) == 0  # a vector routed to Muon by a shapes file: no matrix


def test_every_muon_matrix_is_orthogonalized_by_one_rank(planned) -> None:
    plan, specs = planned
    per_rank = rank_ns_flops(plan)
    assert len(per_rank) == plan.shard_group_size
    assert sum(per_rank) == sum(ns_flops(s.shape) for s in specs if s.matrix)


def test_the_projection_adds_its_terms() -> None:
    plan, specs = _plan("llama3-8b", 64, 8)
    costs = plan_costs(plan, specs, Mode(param_dtype="bfloat16"))
    p = project(costs, "nvlink4-ndr400", "h100")
    fabric, (peak, _) = FABRICS["nvlink4-ndr400"], GPUS["h100"]
    assert p.comm_s == pytest.approx(
        sum(collective_seconds(c, plan, fabric) for c in costs.collectives)
    )
    assert p.newton_schulz_s == max(rank_ns_flops(plan)) / peak
    assert p.step_s == pytest.approx(p.comm_s + p.newton_schulz_s + p.elementwise_s)
    assert 0 < p.elementwise_s < p.newton_schulz_s < p.comm_s
    assert p.as_dict()["step_s"] == p.step_s
    assert p.describe().startswith(f"{p.step_s:.3g} s per step beyond forward and backward")
    faster = project(costs, "nvlink4-ndr400", "b200")
    assert faster.comm_s == p.comm_s and faster.newton_schulz_s < p.newton_schulz_s
    with pytest.raises(ValueError, match="unknown fabric"):
        project(costs, "carrier-pigeon", "h100")
    with pytest.raises(ValueError, match="unknown GPU"):
        project(costs, "nvlink4-ndr400", "tpu")


SCALES = [
    pytest.param(name, dp, id=f"{name}-dp{dp}", marks=[pytest.mark.slow] * (slow and dp < 1024))
    for name, slow in (("llama3-8b", 0), ("qwen3-30b-a3b", 0), ("llama3-70b", 0), ("moe-256x", 1))
    for dp in (8, 64, 256, 1024)
]
"""The presets at dp 8-1024; moe-256x (15,102 buckets, seconds a plan) only at 1024 but in soaks."""


@pytest.mark.parametrize(("name", "dp"), SCALES)
def test_a_step_issues_two_collectives_per_bucket_at_any_scale(name: str, dp: int) -> None:
    """What `wholeshard plan --preset P --dp N` reports (one shard group, the defaults): at most
    one reduction and one gather per bucket (an owner bucket's reduces and broadcasts are one
    coalesced group each, however many owners it has), plus the step check and the grad norm,
    and an exchange plan's two all-to-alls; the bytes a rank sends within 5% of a ring
    reduce-scatter (fp32 grads) and all-gather (bf16 params) of the model's params, and the
    exchange's about 1/dp more."""
    specs = preset(name)
    used = sum(s.numel for s in specs)
    plan = plan_for(specs, dp)
    costs = plan_costs(plan, specs, Mode(param_dtype="bfloat16"))
    buckets = sum(len(b.buckets) for b in plan.buffers)
    a2a = costs.counts().get("all_to_all", 0)
    assert a2a == (2 if plan.strategy == "exchange" else 0), costs.counts()
    assert len(costs.collectives) <= 2 * buckets + 2 + a2a, (buckets, costs.counts())
    ring = (dp - 1) / dp * used * (4 + 2)
    exchanged = costs.bytes_by_op().get("all_to_all", 0)  # about a rank's owned share, 1/dp
    assert abs(costs.bytes_sent - exchanged - ring) <= 0.05 * ring, costs.bytes_sent / ring
    assert exchanged <= (1 / dp + 0.01) * ring, exchanged / ring
