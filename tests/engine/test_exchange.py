"""The exchange strategy in the engine ([Note: exchange buffers] in `planning._exchange`):
reduce-scatter per layer, the reduced matrix pieces exchanged to their owners, the updated pieces
back, all-gather. Checked against the one-process reference, and bit for bit between the modes
that do the same arithmetic."""

from __future__ import annotations

import pytest
import torch
from support import (
    OVERLAP,
    SYNC,
    assert_bitwise_equal,
    assert_matches,
    make_model,
    reference_run,
    run,
    train_part,
    wholeshard_run,
)
from test_stacks import make_moe

from wholeshard.engine.config import ConfigError, Variant
from wholeshard.planning._exchange import segments

STEPS = 3
EXCHANGE = dict(strategy="exchange", bucket_size=3000)


@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.core), 3, 4, 8])
def test_matches_reference(nproc: int) -> None:
    ref = reference_run(STEPS, clip=0.3, world=nproc)
    outs = run(wholeshard_run, nproc, STEPS, clip=0.3, ddp_kw=EXCHANGE)
    for out in outs:
        assert_matches(out, ref, torch.float32)
        assert out["norms"] == pytest.approx(ref["norms"], rel=1e-4)
    for out in outs[1:]:  # every rank gathered the same params
        assert all(torch.equal(out["params"][k], v) for k, v in outs[0]["params"].items())


def _exchanged(ddp_kw: dict) -> dict:
    """Train, and say whether the plan made the exchange move anything."""
    out = wholeshard_run(STEPS, clip=0.3, ddp_kw=ddp_kw, keep_ddp=True)
    (buffer,) = out.pop("ddp").plan.buffers
    return out | {"kind": buffer.kind, "segments": len(segments(buffer))}


def test_modes_that_do_the_same_arithmetic_are_bitwise_equal() -> None:
    """Overlap on or off, one exchange per step or per bucket, the pipelined step: the same
    sums, moved differently."""
    base = run(_exchanged, 4, dict(EXCHANGE, **SYNC))
    assert base[0]["kind"] == "exchange" and base[0]["segments"] > 0  # not vacuous
    for kw in (
        OVERLAP,
        dict(exchange_every=1),
        dict(exchange_every=2, **OVERLAP),
        dict(pipelined_step=True, **OVERLAP),
        dict(pipelined_step=True, exchange_every=1),
    ):
        for a, b in zip(base, run(_exchanged, 4, dict(EXCHANGE, **kw)), strict=True):
            assert_bitwise_equal(a, b)


def test_shard_groups_and_bf16_match_reference() -> None:
    ref = reference_run(STEPS, clip=0.3)
    for out in run(wholeshard_run, 4, STEPS, clip=0.3, ddp_kw=dict(EXCHANGE, shard_group_size=2)):
        assert_matches(out, ref, torch.float32)
    ref = reference_run(STEPS, param_dtype=torch.bfloat16)
    outs = run(wholeshard_run, 3, STEPS, param_dtype=torch.bfloat16, ddp_kw=EXCHANGE)
    for out in outs:
        assert_matches(out, ref, torch.bfloat16)


def test_expert_stacks_match_per_expert_muon() -> None:
    """A stack's matrices are owned one by one, on ranks other than the shards holding them."""
    ref = reference_run(4, make=make_moe)
    for out in run(wholeshard_run, 3, 4, make=make_moe, ddp_kw=dict(EXCHANGE, bucket_size=1500)):
        assert_matches(out, ref, torch.float32)


def test_a_bad_exchange_batching_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="exchange_every must be None"):
        Variant(exchange_every=0)


@pytest.mark.parametrize(
    ("save", "load"),
    [((3, EXCHANGE), (2, dict(bucket_size=3000))), ((2, dict(bucket_size=3000)), (4, EXCHANGE))],
    ids=["exchange-3-to-balanced-2", "balanced-2-to-exchange-4"],
)
def test_checkpoints_load_across_schemes_and_world_sizes(tmp_path, save, load) -> None:
    path = str(tmp_path / "ckpt")
    saved = run(train_part, save[0], path, range(0, 2), False, make_model, **save[1])[0]
    outs = run(train_part, load[0], path, range(2, 4), True, make_model, **load[1])
    assert {saved["kind"], outs[0]["kind"]} == {"exchange", "matrix"}  # across schemes
    ref = reference_run(4)
    for out in outs:
        assert_matches(out | {"losses": ref["losses"]}, ref, torch.float32)  # params only


def _without_all_to_all() -> str:
    import torch.distributed as dist

    def lacking(*args, **kwargs):
        raise RuntimeError("ProcessGroupX does not support alltoall_base")

    dist.all_to_all_single = lacking
    try:
        wholeshard_run(1, ddp_kw=EXCHANGE)
    except RuntimeError as e:
        return str(e)
    return "trained"


def test_a_backend_without_all_to_all_is_named_on_every_rank() -> None:
    for said in run(_without_all_to_all, 2):
        assert "has no all-to-all with split sizes" in said and "strategy" in said, said
