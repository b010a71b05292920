"""The pipelined optimizer step (`DataParallel(..., pipelined_step=True)`): the same per-param
arithmetic as the unpipelined step, so bitwise the same training, with each bucket's gather
dispatched as soon as the bucket is updated."""

from __future__ import annotations

import pytest
import torch
from support import (
    DTYPES,
    OVERLAP,
    SYNC,
    assert_bitwise_equal,
    fp8_model,
    grid,
    local_loss,
    run,
    wholeshard_run,
    wrapped,
)
from torch.profiler import ProfilerActivity, profile

from wholeshard import fp8

STEPS = 4
SMALL_BUCKETS = dict(bucket_size=3000)  # several buckets, so there is something to pipeline
PIPELINED = dict(pipelined_step=True)
GATHER_MODES = {
    "sync": SYNC,
    "grad-overlap": dict(overlap_grad_reduce=True),
    "overlap": OVERLAP,
}


def _pairs(modes: dict[str, dict], clips=(None, 0.5), **kw) -> dict:
    """Per mode and clipping: (unpipelined, pipelined) results, all in one launch."""
    out = {}
    for name, mode in modes.items():
        ddp_kw = dict(SMALL_BUCKETS, **mode)
        for clip in clips:
            common = dict(clip=clip, evaluate=True, **kw)
            plain = wholeshard_run(STEPS, ddp_kw=ddp_kw, **common)
            pipelined = wholeshard_run(STEPS, ddp_kw=dict(ddp_kw, **PIPELINED), **common)
            out[name, clip] = (plain, pipelined)
    return out


def _assert_pairs_equal(outs: list[dict]) -> None:
    for rank_out in outs:
        for key, (plain, pipelined) in rank_out.items():
            assert_bitwise_equal(plain, pipelined)
            assert plain["norms"] == pipelined["norms"], key
            assert plain["evals"] == pipelined["evals"], f"{key}: forwards between steps"


@pytest.mark.parametrize(
    ("nproc", "dtype"),
    grid({2: 2, 3: 3}, DTYPES, core="3-fp32", slow=("2-fp32", "2-bf16", "3-bf16")),
    # bf16 pipelined stays fast in test_plan_agrees (exchange-8-per-bucket-bf16), bitwise on GPU
)
def test_pipelined_is_bitwise_equal_to_unpipelined(nproc: int, dtype: torch.dtype) -> None:
    _assert_pairs_equal(run(_pairs, nproc, GATHER_MODES, param_dtype=dtype))


SHARDED_MODES = {
    "fully_sharded": dict(reshard_after_forward=True, **OVERLAP),
    "shard_groups": dict(shard_group_size=2, **OVERLAP),
}
MORE_SHARDED_MODES = {
    "fully_sharded-sync": dict(reshard_after_forward=True),
    "shard_groups-fully_sharded": dict(shard_group_size=2, reshard_after_forward=True),
}


@pytest.mark.parametrize(
    "modes", [SHARDED_MODES, pytest.param(MORE_SHARDED_MODES, marks=pytest.mark.slow)]
)
def test_fully_sharded_and_shard_groups(modes: dict) -> None:
    _assert_pairs_equal(run(_pairs, 4, modes))


def test_accumulation_schedules_one_group_and_ping_pong() -> None:
    """no_sync micro-batches with an LR schedule; gathers on the one process group; the legacy
    ping-pong baseline with broadcasts."""
    modes = {
        "one-group": dict(separate_all_gather_group=False, **OVERLAP),
        "ping_pong-broadcast": dict(layout="ping_pong_broadcasts", **OVERLAP),
    }
    outs = run(_pairs, 2, modes, clips=(0.5,), micro_batches=3, lr_lambda=lambda s: 0.7**s)
    _assert_pairs_equal(outs)


def _fp8_pairs() -> dict:
    out = {}
    for recipe in fp8.RECIPES:
        mode = {recipe: dict(fp8_param_gather=True, **OVERLAP)}
        kw = dict(make=fp8_model(recipe), param_dtype=torch.bfloat16)
        out |= _pairs(mode, clips=(None,), **kw)
    return out


def test_fp8_param_gather() -> None:
    _assert_pairs_equal(run(_fp8_pairs, 2))


# -- the order of events ------------------------------------------------------------------------

GATHER = "wholeshard.param_sync.start"
UPDATES = ("Optimizer.step#Muon.step", "Optimizer.step#AdamW.step")  # torch's own labels


def _step_events(ddp_kw: dict) -> dict:
    """The trace of one optimizer step: (start, end, name) of wholeshard's labels and of the
    inner optimizers' steps."""
    ddp, opt = wrapped(**SMALL_BUCKETS, **ddp_kw)
    local_loss(ddp).backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    events = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.name.startswith("wholeshard.") or e.name in UPDATES
    ]
    return {"buckets": len(ddp.units), "events": sorted(events)}


def _inside(event: tuple, span: tuple) -> bool:
    return span[0] <= event[0] and event[1] <= span[1]


@pytest.mark.parametrize("ddp_kw", [OVERLAP, dict(reshard_after_forward=True, **OVERLAP)])
def test_bucket_gathers_leave_before_the_last_bucket_is_updated(ddp_kw: dict) -> None:
    fully_sharded = ddp_kw.get("reshard_after_forward", False)
    updated_last = []
    for out in run(_step_events, 2, dict(ddp_kw, **PIPELINED)):
        n, events = out["buckets"], out["events"]
        assert n > 2
        spans = [e for e in events if e[2].startswith("wholeshard.step.unit")]
        assert [e[2] for e in spans] == [f"wholeshard.step.unit{i}" for i in range(n)]
        updates = [e for e in events if e[2] in UPDATES]
        assert all(any(_inside(u, s) for s in spans) for u in updates), "updates are per bucket"
        gathers = [e for e in events if e[2] == GATHER]
        if fully_sharded:
            assert gathers == [], "fully sharded: the next forward gathers"
            continue
        assert len(gathers) == n
        assert all(_inside(g, s) for g, s in zip(gathers, spans, strict=True))
        assert gathers[0][0] < spans[-1][0], "bucket 0 gathers before the last one's update"
        updated_last.append(any(_inside(u, spans[-1]) for u in updates))
    assert fully_sharded or any(updated_last), "some rank updates params of the last bucket"


def test_unpipelined_step_gathers_after_every_update() -> None:
    """The contrast the test above relies on: without pipelining the first gather leaves after
    the last update."""
    for out in run(_step_events, 2, dict(OVERLAP, overlap_param_gather=False)):
        events = out["events"]
        gathers = [e for e in events if e[2] == GATHER]
        updates = [e for e in events if e[2] in UPDATES]
        assert gathers and updates
        assert gathers[0][0] > updates[-1][1]
