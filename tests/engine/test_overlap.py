"""Overlapped and legacy sync modes: bitwise equal to synchronous, matching the reference."""

from __future__ import annotations

import pytest
import torch
from support import (
    DTYPES,
    OVERLAP,
    SYNC,
    assert_bitwise_equal,
    assert_matches,
    grid,
    local_loss,
    reference_run,
    run,
    wholeshard_run,
    wrapped,
)

from wholeshard.engine._storage import UnitState

SMALL_BUCKETS = dict(bucket_size=3000)  # several buckets, so overlap has something to overlap
MODES = {
    "whole": {},
    "whole-overlap": OVERLAP,
    "whole-broadcast": dict(layout="shard_broadcasts"),
    "ping_pong": dict(layout="ping_pong"),
    "ping_pong-overlap": dict(layout="ping_pong", **OVERLAP),
    "ping_pong-broadcast": dict(layout="ping_pong_broadcasts"),
    "ping_pong-broadcast-overlap": dict(layout="ping_pong_broadcasts", **OVERLAP),
}
LAYOUTS = {"whole": None, "ping_pong": "ping_pong"}  # the design's plan, and the legacy one


def _run(nproc: int, mode: dict, steps: int = 3, **kw) -> list[dict]:
    return run(wholeshard_run, nproc, steps, ddp_kw=dict(SMALL_BUCKETS, **mode), **kw)


@pytest.mark.parametrize(
    ("layout", "dtype"),
    grid(LAYOUTS, DTYPES, core="whole-fp32"),
)
def test_overlap_is_bitwise_equal_to_sync(layout: str | None, dtype: torch.dtype) -> None:
    sync = _run(3, dict(layout=layout), param_dtype=dtype, evaluate=True)
    overlap = _run(3, dict(layout=layout, **OVERLAP), param_dtype=dtype, evaluate=True)
    for a, b in zip(sync, overlap, strict=True):
        assert_bitwise_equal(a, b)
        assert a["evals"] == b["evals"], "evaluation between steps sees the updated params"


@pytest.mark.parametrize(
    ("gathers", "broadcasts"),
    [(None, "shard_broadcasts"), ("ping_pong", "ping_pong_broadcasts")],
    ids=["whole", "ping_pong"],
)
def test_broadcast_is_bitwise_equal_to_allgather(gathers: str | None, broadcasts: str) -> None:
    gather = _run(3, dict(layout=gathers))
    bcast = _run(3, dict(layout=broadcasts))
    for a, b in zip(gather, bcast, strict=True):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=pytest.mark.core) if m == "whole-overlap" else m for m in MODES]
)
def test_every_mode_matches_reference(mode: str) -> None:
    ref = reference_run(3)
    for out in _run(2, MODES[mode]):
        assert_matches(out, ref)


@pytest.mark.parametrize("mode", ["whole", "whole-overlap", "ping_pong-overlap"])
def test_no_sync_accumulation_matches_one_full_batch_step(mode: str) -> None:
    ref = reference_run(3)
    for out in _run(2, MODES[mode], micro_batches=4):
        assert_matches(out, ref)


def only_one_matrix(name: str, param: torch.nn.Parameter) -> bool:
    return name == "blocks.0.qkv.weight"


@pytest.mark.parametrize("mode", list(MODES))
def test_fewer_muon_matrices_than_ranks(mode: str) -> None:
    ref = reference_run(3, matrix_params=only_one_matrix)
    outs = _run(4, dict(MODES[mode], bucket_size=None), matrix_params=only_one_matrix)
    owns_muon = [any("momentum_buffer" in e for e in out["opt_state"].values()) for out in outs]
    assert owns_muon.count(True) == 1, "one Muon matrix, four ranks: three own no Muon param"
    for out in outs:
        assert_matches(out, ref)


@pytest.mark.parametrize("mode", ["whole-overlap", "ping_pong-overlap"])
def test_param_unused_in_forward(mode: str) -> None:
    ref = reference_run(3, unused_param=True)
    for out in _run(2, MODES[mode], unused_param=True):
        assert_matches(out, ref)


def _dispatch_points(mode: dict) -> dict:
    ddp, opt = wrapped(**SMALL_BUCKETS, **mode)
    local_loss(ddp).backward()
    during_backward = sum(b.reducing is not None for b in ddp.units)
    opt.step()
    after_step = sum(b.state is not UnitState.FRESH for b in ddp.units)
    return {"buckets": len(ddp.units), "rs": during_backward, "ag": after_step}


def test_overlap_dispatches_during_backward_and_defers_gathers() -> None:
    sync = run(_dispatch_points, 2, SYNC)[0]
    overlap = run(_dispatch_points, 2, OVERLAP)[0]
    assert sync["buckets"] > 2
    assert sync["rs"] == 0 and sync["ag"] == 0
    assert overlap["rs"] == overlap["buckets"], "every bucket reduced while backward ran"
    assert overlap["ag"] == overlap["buckets"], "gathers left for the next forward"


def _in_flight_protocol(mode: dict) -> dict:
    ddp, opt = wrapped(**SMALL_BUCKETS, **mode)
    local_loss(ddp).backward()
    opt.step()
    opt.zero_grad()
    opt.step()  # a second step while the first step's all-gathers may still be in flight
    ddp.finish_param_sync()
    ddp.finish_param_sync()  # idempotent
    ddp.free_overlap_buffers()
    ddp.free_overlap_buffers()  # idempotent, safe with nothing pending
    with torch.no_grad():
        evaluation = local_loss(ddp, 1).item()
    return {
        "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
        "eval": evaluation,
    }


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_second_step_with_gather_in_flight(layout: str | None) -> None:
    sync = run(_in_flight_protocol, 2, dict(layout=layout))
    overlap = run(_in_flight_protocol, 2, dict(layout=layout, **OVERLAP))
    for a, b in zip(sync, overlap, strict=True):
        assert a["eval"] == b["eval"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def test_bad_mode_names() -> None:
    with pytest.raises(ValueError, match="layout 'zigzag' is not registered .*ping_pong"):
        wrapped(layout="zigzag")
    ddp, _ = wrapped(layout="ping_pong")
    assert ddp.plan.buffers[0].kind == "unaligned"
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        wrapped(scheme="ping_pong")  # no such option
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        wrapped(param_sync="broadcast")
