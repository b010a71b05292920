"""Fully sharded mode on the exchange strategy ([Note: owned copies] in
`engine._owned_copies`): each rank keeps its equal shards and whole copies of the matrices it
owns, their grads only through the step, and their params too where the optimizer keeps
separate masters (bf16). The same arithmetic as ZeRO-1/2 on the exchange plan, so the two are
compared bitwise; both against the one-process reference."""

from __future__ import annotations

import gc

import pytest
import torch
from support import (
    ADAMW_KW,
    MUON_KW,
    OVERLAP,
    assert_bitwise_equal,
    assert_matches,
    local_loss,
    mp,
    reference_run,
    run,
    train_steps,
    wholeshard_run,
    wrapped,
)
from test_stacks import make_moe

import wholeshard
from wholeshard.optim._offload import StateOffload
from wholeshard.planning._exchange import matrix_ranges, pieces, segments

STEPS = 3
EXCHANGE = dict(strategy="exchange", bucket_size=3000)
FS = dict(reshard_after_forward=True)


def _both(ddp_kw: dict, offload: bool = False, **kw) -> dict:
    """The same training on the exchange plan in ZeRO-1/2 mode and fully sharded, in one
    launch, with no-grad forwards after every step; and what the fully sharded rank keeps.
    `offload`: masters and state in host memory, copied as on a GPU."""
    ddp_kw = dict(EXCHANGE, **ddp_kw)
    if offload:
        StateOffload.force_copies = True  # this worker's
        kw["opt_kw"] = dict(offload_state=True)
    zero = wholeshard_run(STEPS, ddp_kw=ddp_kw, evaluate=True, **kw)
    kept = dict(keep_ddp=True, keep_opt=True)
    fs = wholeshard_run(STEPS, ddp_kw=dict(ddp_kw, **FS), evaluate=True, **kept, **kw)
    ddp, _opt = fs.pop("ddp"), fs.pop("opt")  # the optimizer alive: its masters hold values
    units = ddp.units
    (buffer,) = ddp.plan.buffers
    rank = ddp.plan.shard_rank(torch.distributed.get_rank())
    return {
        "zero": zero,
        "fs": fs,
        "memory": ddp.memory(),
        "shards": sum(u.param_shard.numel() for u in units),
        "copies": sum(u.owned_copies.param.numel() for u in units),
        "grad_copies": sum(u.owned_copies.grad.numel() for u in units),
        "grad_storage": sum(u.owned_copies.grad.untyped_storage().nbytes() for u in units),
        "param_storage": sum(u.owned_copies.param.untyped_storage().nbytes() for u in units),
        "owned": sum(hi - lo for _, lo, hi, o in matrix_ranges(buffer) if o == rank),
        "moved": len(segments(buffer)),
        "local": sum(s.holder == s.owner for s in pieces(buffer)),
        "elem": (units[0].param.element_size(), units[0].grad.element_size()),
    }


def _assert_fs_equals_zero(nproc: int, ddp_kw: dict, offload: bool = False, **kw) -> None:
    ref = reference_run(STEPS, **kw)
    outs = run(_both, nproc, ddp_kw, offload, **kw)
    assert outs[0]["moved"] > 0 and outs[0]["local"] > 0  # both ways of reaching an owner
    dtype = kw.get("param_dtype", torch.float32)
    masters = dtype != torch.float32  # separate from the params: the param copies go too
    for out in outs:
        assert_bitwise_equal(out["fs"], out["zero"])
        assert out["fs"]["evals"] == out["zero"]["evals"], "no-grad forwards between steps"
        assert_matches(out["fs"], ref, dtype)
        # memory(): this rank's shards plus, in fp32, its owned copies' params; the owned grad
        # copies (as large as the param copies), and with separate masters the param copies,
        # hold no storage between steps.
        assert out["copies"] == out["grad_copies"] == out["owned"] > 0
        kept = out["shards"] + out["copies"] * (not masters)
        assert out["memory"]["params"] == kept * out["elem"][0]
        assert out["memory"]["grads"] == out["shards"] * out["elem"][1]
        assert out["grad_storage"] == 0
        assert out["param_storage"] == out["copies"] * out["elem"][0] * (not masters)


@pytest.mark.parametrize(
    ("nproc", "overlap", "dtype"),
    [
        pytest.param(2, False, torch.float32, marks=pytest.mark.core),
        (2, True, torch.float32),
        (3, True, torch.bfloat16),
        (4, False, torch.float32),
    ],
    ids=["2-sync", "2-overlap", "3-overlap-bf16", "4-sync"],
)
def test_fully_sharded_is_bitwise_equal_to_zero(nproc: int, overlap: bool, dtype) -> None:
    """In bf16 with a layer that never gets a gradient: its owner writes its param from the
    master anyway, since the param copy holds nothing between steps."""
    bf16 = dict(param_dtype=dtype, unused_param=True) if dtype == torch.bfloat16 else {}
    _assert_fs_equals_zero(nproc, OVERLAP if overlap else {}, **bf16)


def test_shard_groups_pipelined_and_batched_exchanges() -> None:
    """The second pipelined too, in bf16 with offloaded masters and an unused layer alone in
    the first unit (1500-element buckets): the offloaded walk writes the params of pieces that
    did not step from their host masters."""
    _assert_fs_equals_zero(4, dict(shard_group_size=2, pipelined_step=True, **OVERLAP))
    bf16 = dict(param_dtype=torch.bfloat16, unused_param=True)
    batched = dict(exchange_every=1, bucket_size=1500, pipelined_step=True, **OVERLAP)
    _assert_fs_equals_zero(3, batched, offload=True, **bf16)


def test_expert_stacks() -> None:
    _assert_fs_equals_zero(3, dict(bucket_size=1500, **OVERLAP), make=make_moe)


def _read_after_step(ddp_kw: dict) -> list[str]:
    """Step, then read the owned grads again before `zero_grad()`: each raises; after
    `zero_grad()` and a backward the next step runs."""
    ddp, opt = wrapped(**dict(EXCHANGE, **FS, **ddp_kw))
    errors = []
    local_loss(ddp, 0).backward()
    opt.step()
    for again in (opt.step, lambda: opt.clip_grad_norm_(1.0)):
        with pytest.raises(RuntimeError, match="already used by optimizer.step") as e:
            again()
        errors.append(str(e.value))
    opt.zero_grad()
    local_loss(ddp, 1).backward()
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    return errors


@pytest.mark.parametrize("ddp_kw", [{}, dict(pipelined_step=True, exchange_every=1)])
def test_a_step_frees_the_owned_grads_so_reading_them_again_raises(ddp_kw: dict) -> None:
    errors = run(_read_after_step, 2, ddp_kw)
    assert [len(e) for e in errors] == [2, 2]  # raised on every rank, twice


def _optimizer_after_optimizer() -> list[bool]:
    """bf16, the owned param copies held by the optimizer's masters between steps: an
    optimizer built beside the one that stepped, and one built after that one is gone, each
    start from the params the last one stepped, and step on."""
    ddp, first = wrapped(mp_policy=mp(torch.bfloat16), **EXCHANGE, **FS)
    same = []
    for step, drop_first in enumerate((False, True)):
        train_steps(ddp, first, [step])
        values = {o.key: o.value().clone() for o in first.owned_pieces()}
        if drop_first:
            del first
            gc.collect()
        first = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
        now = {o.key: o.value() for o in first.owned_pieces()}
        same.append(
            now.keys() == values.keys() and all(map(torch.equal, now.values(), values.values()))
        )
    train_steps(ddp, first, [2])
    return same


def test_an_optimizer_built_after_another_starts_from_its_params() -> None:
    assert run(_optimizer_after_optimizer, 2) == [[True, True]] * 2
