"""Two-level groups in the engine ([Note: two-level groups] in `planning.plan`): each bucket
reduce-scattered within the node, then across nodes, and gathered back the other way, shards
dealt by shard index (local x nodes + node). Checked against the one-process reference, bit for
bit between the modes that do the same arithmetic, and the shard indices and groups against
the plan."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support import (
    OVERLAP,
    SYNC,
    assert_bitwise_equal,
    assert_matches,
    fp8_model,
    make_model,
    reference_run,
    run,
    train_part,
    wholeshard_run,
)

from wholeshard.engine.config import ConfigError
from wholeshard.engine.config import DataParallelConfig as Config
from wholeshard.planning._exchange import segments

STEPS = 3
TWO = dict(strategy="exchange", bucket_size=3000, node_size=2)


def _trained(ddp_kw: dict, **kw) -> dict:
    """Train; with the shard index, the groups' sizes and whether the exchange moved pieces."""
    out = wholeshard_run(STEPS, clip=0.3, ddp_kw=ddp_kw, keep_ddp=True, **kw)
    ddp = out.pop("ddp")
    levels = ddp.units[0].groups.levels
    sizes = None if levels is None else tuple(map(dist.get_world_size, (levels.node, levels.cross)))
    moved = sum(len(segments(b)) for b in ddp.plan.buffers if b.kind == "exchange")
    return out | {"shard": ddp.shard_rank, "sizes": sizes, "moved": moved}


@pytest.mark.parametrize(
    ("nproc", "ddp_kw", "sizes"),
    [
        pytest.param(4, dict(TWO, **OVERLAP), (2, 2), marks=pytest.mark.core, id="exchange-4"),
        pytest.param(8, dict(TWO, node_size=4), (4, 2), id="exchange-8-nodes-of-4"),
        pytest.param(8, dict(TWO, shard_group_size=4), (2, 2), id="exchange-shard-groups-8"),
        pytest.param(
            4,
            dict(TWO, strategy="balanced", reshard_after_forward=True),
            (2, 2),
            id="balanced-fully-sharded-4",
        ),  # fmt: skip
    ],
)
def test_matches_reference(nproc: int, ddp_kw: dict, sizes: tuple[int, int]) -> None:
    ref = reference_run(STEPS, clip=0.3, world=nproc)
    outs = run(_trained, nproc, ddp_kw)
    k, n = ddp_kw.get("shard_group_size", nproc), ddp_kw["node_size"]
    # local x nodes + node: the shards of a shard group's ranks, in rank order
    assert [o["shard"] for o in outs[:k]] == [(r % n) * (k // n) + r // n for r in range(k)]
    for out in outs:
        assert out["sizes"] == sizes
        assert_matches(out, ref, torch.float32)
        assert out["norms"] == pytest.approx(ref["norms"], rel=1e-4)
    for out in outs[1:]:  # every rank gathered the same params
        assert all(torch.equal(out["params"][k], v) for k, v in outs[0]["params"].items())
    assert outs[0]["moved"] > 0 or ddp_kw["strategy"] == "balanced"


def test_modes_that_do_the_same_arithmetic_are_bitwise_equal() -> None:
    """Overlap, one exchange per bucket, the pipelined step and fully sharded: the same two-level
    sums, moved at other times."""
    base = run(_trained, 4, dict(TWO, **SYNC))
    for kw in (
        dict(exchange_every=1, **OVERLAP),
        dict(pipelined_step=True, **OVERLAP),
        dict(reshard_after_forward=True, **OVERLAP),
    ):
        for a, b in zip(base, run(_trained, 4, dict(TWO, **kw)), strict=True):
            assert_bitwise_equal(a, b)


def _fp8_on_and_off() -> tuple[dict, dict]:
    kw = dict(TWO, **OVERLAP)
    common = dict(make=fp8_model("tensorwise"), param_dtype=torch.bfloat16, evaluate=True)
    off = wholeshard_run(STEPS, ddp_kw=kw, **common)
    on = wholeshard_run(STEPS, ddp_kw=dict(kw, fp8_param_gather=True), keep_ddp=True, **common)
    ddp = on.pop("ddp")
    assert ddp.fp8_param_gather and ddp.units[0].groups.levels is not None
    return off, on


def test_fp8_param_gather_is_bitwise_equal_to_quantizing_every_forward() -> None:
    """Tensorwise FP8 bytes sent from the owners to the holders and gathered in two levels,
    with their scales by shard index."""
    for off, on in run(_fp8_on_and_off, 4):
        assert_bitwise_equal(on, off)
        assert on["evals"] == off["evals"]


def test_checkpoints_load_across_group_structures_and_world_sizes(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    run(train_part, 4, path, range(0, 2), False, make_model, **TWO)
    outs = run(train_part, 2, path, range(2, 4), True, make_model, bucket_size=3000)
    ref = reference_run(4)
    for out in outs:
        assert_matches(out | {"losses": ref["losses"]}, ref, torch.float32)  # params only


def _refused(ddp_kw: dict) -> str:
    try:
        wholeshard_run(1, ddp_kw=ddp_kw)
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.parametrize(
    ("ddp_kw", "said"),
    [
        (dict(TWO, node_size=3), "does not divide the shard group size 4"),
        (dict(TWO, strategy="owners"), "pass strategy='exchange'"),
        (
            dict(TWO, strategy="balanced", layout="shard_broadcasts"),
            "syncs buckets by 'shard_broadcasts'; leave node_size unset",
        ),
    ],
    ids=["node-size", "owners", "broadcast"],
)
def test_a_structure_that_does_not_fit_is_refused_on_every_rank(ddp_kw: dict, said: str) -> None:
    for out in run(_refused, 4, ddp_kw):
        assert said in out, out


def test_a_bad_node_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="node_size must be None"):
        Config(node_size=0)
