"""Fully sharded mode (`reshard_after_forward=True`) and the separate all-gather group.

Fully sharded runs the same arithmetic as ZeRO-1/2 mode on the same plan, so the two are
compared bitwise; both are compared with the single-process reference.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from support import (
    DTYPES,
    OVERLAP,
    SYNC,
    assert_bitwise_equal,
    assert_matches,
    batch,
    data_parallel,
    grid,
    lm_loss,
    local_loss,
    make_model,
    mp,
    reference_run,
    run,
    wholeshard_run,
    wrapped,
)
from test_frozen import make_adapted

from wholeshard.distributed import collectives

FS = dict(reshard_after_forward=True)
SMALL_BUCKETS = dict(bucket_size=3000)  # several buckets: releases and prefetches to get wrong
STEPS = 3


def _both(ddp_kw: dict, **kw) -> dict:
    """The same training in ZeRO-1/2 mode and fully sharded, in one launch."""
    ddp_kw = dict(SMALL_BUCKETS, **ddp_kw)
    return {
        "zero": wholeshard_run(STEPS, ddp_kw=ddp_kw, evaluate=True, **kw),
        "fs": wholeshard_run(STEPS, ddp_kw=dict(ddp_kw, **FS), evaluate=True, **kw),
    }


def _assert_fs_equals_zero(nproc: int, ddp_kw: dict, dtype: torch.dtype, **kw) -> None:
    ref = reference_run(STEPS, param_dtype=dtype)
    for out in run(_both, nproc, ddp_kw, param_dtype=dtype, **kw):
        assert_bitwise_equal(out["fs"], out["zero"])
        assert out["fs"]["evals"] == out["zero"]["evals"], "no-grad forwards between steps"
        assert_matches(out["fs"], ref, dtype)


@pytest.mark.parametrize(  # fp32 at 2 ranks, bf16 at 3 (the other pairs: `make soak`)
    ("nproc", "dtype", "overlap"),
    grid(
        {2: 2, 3: 3},
        DTYPES,
        {"sync": False, "overlap": True},
        core=("2-fp32-sync", "2-fp32-overlap"),
        slow=("2-bf16-sync", "2-bf16-overlap", "3-fp32-sync", "3-fp32-overlap"),
    ),
)
def test_fully_sharded_is_bitwise_equal_to_zero(nproc: int, dtype, overlap: bool) -> None:
    _assert_fs_equals_zero(nproc, OVERLAP if overlap else {}, dtype)


@pytest.mark.parametrize("nproc", [2, 3])
def test_owner_buckets_fully_sharded_are_bitwise_equal_to_zero(nproc: int) -> None:
    """Owner buckets (reduce to the owner, broadcast from it), most holding fewer matrices than
    ranks: fully sharded and overlapped equals ZeRO-1/2 bit for bit, and matches the reference."""
    _assert_fs_equals_zero(nproc, dict(strategy="owners", **OVERLAP), torch.bfloat16)


@pytest.mark.parametrize(
    "overlap", [pytest.param(False, marks=pytest.mark.core), True], ids=["sync", "overlap"]
)
def test_hybrid_sharding_in_shard_groups(overlap: bool) -> None:
    mode = dict(shard_group_size=2, **(OVERLAP if overlap else {}))
    _assert_fs_equals_zero(4, mode, torch.float32)


@pytest.mark.parametrize(
    ("overlap", "dtype"),
    [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)],
    ids=["sync", "overlap", "overlap-bf16"],
)
def test_no_sync_accumulation(overlap: bool, dtype: torch.dtype) -> None:
    """bf16: the first micro-batch's gradients are kept until the second's arrive ([Note: kept
    gradients]); the sums are ZeRO's bits."""
    _assert_fs_equals_zero(2, OVERLAP if overlap else {}, dtype, micro_batches=3)


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param(dict(model_kw=dict(tied=True)), id="tied-head"),
        pytest.param(dict(unused_param=True), id="unused-param"),
        pytest.param(dict(make=make_adapted, param_dtype=torch.bfloat16), id="frozen-base"),
    ],
)
def test_models_with_shared_unused_or_frozen_params(kw: dict) -> None:
    for out in run(_both, 2, OVERLAP, **kw):
        assert_bitwise_equal(out["fs"], out["zero"])
        assert out["fs"]["evals"] == out["zero"]["evals"]


def test_clipping_and_broadcast_param_sync() -> None:
    ref = reference_run(STEPS, clip=0.5)
    outs = run(_both, 2, dict(layout="shard_broadcasts", **OVERLAP), clip=0.5)
    for out in outs:
        assert_bitwise_equal(out["fs"], out["zero"])
        assert out["fs"]["norms"] == out["zero"]["norms"]
        assert_matches(out["fs"], ref)


# -- memory: only shards between steps ---------------------------------------------------------


def _lifecycle() -> dict:
    model = make_model()
    ddp, opt = wrapped(model, **SMALL_BUCKETS, **FS, **OVERLAP)
    buckets = ddp.units

    def params() -> list[int]:  # bytes of each bucket's full param storage
        return [b.param.untyped_storage().size() for b in buckets]

    def grads() -> list[int]:
        return [b.grad.untyped_storage().size() for b in buckets]

    out = {"n": len(buckets), "full": [b.param.numel() * 4 for b in buckets], "init": params()}
    out["root"] = [i for i, b in enumerate(buckets) if any(p is model.pos for p, _ in b.params)]
    loss = local_loss(ddp)
    out["after_forward"] = params()
    loss.backward()
    out["after_backward"] = params()
    opt.step()
    out["after_step"] = (params(), grads())
    with torch.no_grad():
        lm_loss(ddp, *batch(1))
    out["after_eval"] = params()
    weight = model.blocks[0].fc.weight
    out["released_shape"] = tuple(weight.shape)
    try:
        model.state_dict()
        out["state_dict"] = None
    except RuntimeError as e:
        out["state_dict"] = str(e)
    with ddp.full_params():
        out["inside"] = (params(), tuple(weight.shape), len(model.state_dict()))
    out["after_full_params"] = params()
    mem = ddp.memory()
    plan = ddp.plan
    out["memory"] = mem
    out["own_shards"] = sum(b.shard_numel for buf in plan.buffers for b in buf.buckets) * 4
    out["plan"] = (plan.numel, sum(buf.used for buf in plan.buffers))
    out["model_bytes"] = sum(p.numel() for p in make_model().parameters()) * 4
    out["opt_state"] = sum(
        v.numel() * v.element_size()
        for piece in opt.owned_pieces()
        for v in opt.piece_state(piece).values()
    )
    return out


@pytest.mark.core
def test_only_shards_persist_and_full_buckets_are_released() -> None:
    outs = run(_lifecycle, 2)
    for out in outs:
        n, full = out["n"], out["full"]
        assert n > 2
        assert out["init"] == [0] * n
        # The first bucket in backprop order and the one holding the root module's own param
        # stay gathered for backward, as FSDP2 keeps its root's params.
        kept = {0, *out["root"]}
        assert len(kept) == 2
        assert out["after_forward"] == [full[i] if i in kept else 0 for i in range(n)]
        assert out["after_backward"] == [0] * n
        assert out["after_step"] == ([0] * n, [0] * n)
        assert out["after_eval"] == [0] * n
        assert out["released_shape"] == (0,)
        assert "full_params" in out["state_dict"]
        assert out["inside"][0] == full and out["inside"][1] == (128, 32) and out["inside"][2] > 0
        assert out["after_full_params"] == [0] * n
        mem = out["memory"]
        assert mem["params"] == out["own_shards"] == mem["grads"]
        assert mem["masters"] == 0 and mem["frozen_params"] == 0  # fp32: masters are the shards
        assert mem["optimizer_state"] == out["opt_state"] > 0
        assert mem["transient_unit"] == max(f + f for f in full)
    numel, used = outs[0]["plan"]
    model_bytes = outs[0]["model_bytes"]
    assert used * 4 == model_bytes
    # summed over ranks: one copy of the model plus the plan's padding, nothing else
    assert sum(out["memory"]["params"] for out in outs) == numel * 4
    assert numel * 4 - model_bytes == (numel - used) * 4 < 0.2 * model_bytes


def _kept_gradients(dtype: torch.dtype) -> dict:
    """Each unit's kept and full grad bytes after a backward whose reductions wait for the step,
    and after the step."""
    ddp, opt = wrapped(mp_policy=mp(dtype), **SMALL_BUCKETS, **FS, **SYNC)

    def grads() -> list[tuple[int, int]]:
        return [(b.kept.nbytes, b.grad.untyped_storage().size()) for b in ddp.units]

    local_loss(ddp).backward()
    out = {"after_backward": grads()}
    opt.step()
    out["after_step"] = grads()
    out["params"] = [sum(pl.numel for _, pl in b.params) for b in ddp.units]
    out["full"] = [b.grad.numel() * 4 for b in ddp.units]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bf16_gradients_are_kept_as_autograd_made_them_until_the_reduction(dtype) -> None:
    """[Note: kept gradients]: bf16 params with fp32 grads keep autograd's gradients (2 bytes
    an element) and give the full grads no storage until the reduction; fp32 ones are added into
    the full grads on arrival. The step frees both."""
    for out in run(_kept_gradients, 2, dtype):
        if dtype == torch.bfloat16:
            want = [(2 * n, 0) for n in out["params"]]
        else:
            want = [(0, full) for full in out["full"]]
        assert out["after_backward"] == want
        assert out["after_step"] == [(0, 0)] * len(want)


def _zero_memory() -> dict:
    ddp = data_parallel(make_model(), **SMALL_BUCKETS)
    return {"memory": ddp.memory(), "numel": ddp.plan.numel}


def test_zero_mode_memory_is_the_full_buffers() -> None:
    for out in run(_zero_memory, 2):
        mem = out["memory"]
        assert mem["params"] == mem["grads"] == out["numel"] * 4
        assert mem["transient_unit"] == 0


def test_ping_pong_cannot_be_fully_sharded() -> None:
    with pytest.raises(ValueError, match="ping_pong.*cannot take reshard_after_forward"):
        data_parallel(make_model(), layout="ping_pong", **FS)


# -- the separate all-gather group -------------------------------------------------------------


def _groups_used(ddp_kw: dict) -> dict:
    """Train with every collective wholeshard issues recorded with its process group."""
    calls: list[tuple[str, object]] = []

    def recording(name: str, fn):
        def wrapper(*args, **kwargs):
            calls.append((name, inspect.signature(fn).bind(*args, **kwargs).arguments["group"]))
            return fn(*args, **kwargs)

        return wrapper

    originals = {
        name: getattr(collectives, name)
        for name in ("all_gather", "broadcast", "reduce_scatter_sum", "all_reduce_sum")
    }
    for name, fn in originals.items():
        setattr(collectives, name, recording(name, fn))
    first = collectives.broadcast_from_first  # rank 0's initial values: not a param sync

    def unrecorded(tensor, group):
        collectives.wait(originals["broadcast"](tensor, 0, group))

    collectives.broadcast_from_first = unrecorded
    try:
        out = wholeshard_run(STEPS, ddp_kw=dict(SMALL_BUCKETS, **ddp_kw), keep_ddp=True)
    finally:
        for name, fn in originals.items():
            setattr(collectives, name, fn)
        collectives.broadcast_from_first = first
    ddp = out.pop("ddp")
    gathers = [g for name, g in calls if name in ("all_gather", "broadcast")]
    reductions = [g for name, g in calls if name in ("reduce_scatter_sum", "all_reduce_sum")]
    out["gathers_on_gather_group"] = all(g is ddp.gather_group for g in gathers)
    out["reductions_on_gather_group"] = any(g is ddp.gather_group for g in reductions)
    out["separate"] = ddp.gather_group is not ddp.shard_group
    out["counts"] = (len(gathers), len(reductions))
    return out


@pytest.mark.parametrize(
    "ddp_kw",
    [
        pytest.param(dict(**FS, **OVERLAP), id="fully_sharded"),
        pytest.param(dict(**FS, shard_group_size=2), id="fully_sharded-shard_groups"),
        pytest.param(dict(separate_all_gather_group=True, **OVERLAP), id="zero-forced"),
    ],
)
def test_separate_group_carries_every_gather_and_nothing_else(ddp_kw: dict) -> None:
    nproc = 4 if "shard_group_size" in ddp_kw else 2
    separate = run(_groups_used, nproc, ddp_kw)
    one = run(_groups_used, nproc, dict(ddp_kw, separate_all_gather_group=False))
    for a, b in zip(separate, one, strict=True):
        assert a["separate"] and not b["separate"]
        assert a["gathers_on_gather_group"] and not a["reductions_on_gather_group"]
        assert a["counts"][0] > 0 and a["counts"][1] > 0
        assert_bitwise_equal(a, b)


def _trace() -> list[tuple[str, float]]:
    # Buckets of about one matrix each: the last block's complete early in backward.
    ddp, opt = wrapped(bucket_size=1000, **FS, **OVERLAP)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        local_loss(ddp).backward()
        opt.step()
    events = [(e.name, e.time_range.start) for e in prof.events() if "wholeshard." in e.name]
    return sorted(events, key=lambda e: e[1])


def test_trace_shows_backward_regather_while_reduce_scatter_in_flight() -> None:
    events = run(_trace, 2)[0]
    names = [name for name, _ in events]
    first_reduce = names.index("wholeshard.grad_sync.start")
    reduces_waited = names.index("wholeshard.grad_sync.finish")
    assert first_reduce < reduces_waited
    between = names[first_reduce:reduces_waited]
    assert "wholeshard.param_sync.start" in between, "a backward gather under an in-flight reduce"


# -- evaluation and generation ------------------------------------------------------------------


def _greedy(model: torch.nn.Module) -> list[int]:
    tokens = batch(5)[0][:1, :3]
    with torch.no_grad():
        for _ in range(4):
            logits = model(tokens)
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    return tokens[0].tolist()


def test_generation_after_a_step_matches_zero_mode() -> None:
    outs = run(_both, 2, OVERLAP, probe=_greedy)
    for out in outs:
        assert out["fs"]["probe"] == out["zero"]["probe"]
    assert outs[0]["fs"]["probe"] == outs[1]["fs"]["probe"]
