"""Every rank issues the same collectives in the same order, across all its groups, with the same
sizes ([Note: collective order] in `wholeshard/engine/_schedule.py`).

On NCCL two communicators can serialise (`CUDA_DEVICE_MAX_CONNECTIONS=1`, or compute filling the
GPU), so an order that differs between ranks, even across groups, can deadlock; and NCCL needs
equal sizes on every rank. gloo forgives both, so the test records what each rank issues
(operation, group, elements, dtype) through every step of every mode, including steps where one
rank's forward skips a block (an MoE expert no token chose) and activation checkpointing
re-gathers in backward, and compares the sequences. It runs under `TORCH_DISTRIBUTED_DEBUG=DETAIL`
(`run_detail`), which blocks as NCCL does where the order differs across groups, and the last
test checks that DETAIL catches such an order.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from support import (
    ADAMW_KW,
    DETAIL,
    DIM,
    MUON_KW,
    OVERLAP,
    VOCAB,
    Block,
    data_parallel,
    local_batch,
    mp,
    run_detail,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

import wholeshard
from wholeshard import fp8
from wholeshard.distributed import collectives
from wholeshard.distributed.launch import WorkerFailed, launch

Call = tuple[str, str, int, str]


class Branchy(nn.Module):
    """Three blocks; `skip` leaves the middle one out of the forward on this rank (a module no
    token chose), `recompute` runs the blocks under activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.skip = False
        self.recompute = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for i, block in enumerate(self.blocks):
            if self.skip and i == 1:
                continue
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return self.head(x)


def _recording() -> list[tuple]:
    """Record every collective this process issues from now on, through the engine's
    `collectives` and torch's own functions: (op, group, elements, dtype)."""
    calls: list[tuple] = []

    def record(op: str, fn: Callable, sized: bool = True) -> Callable:
        def wrapped(*args, **kwargs):
            t = args[0]
            numel = t.numel() if sized else None  # an all-to-all's sizes differ by rank
            calls.append((op, kwargs.get("group") or dist.group.WORLD, numel, str(t.dtype)))
            return fn(*args, **kwargs)

        return wrapped

    dist.all_reduce = record("all_reduce", dist.all_reduce)
    dist.broadcast = record("broadcast", dist.broadcast)
    dist.reduce = record("reduce", dist.reduce)
    dist.all_to_all_single = record("all_to_all", dist.all_to_all_single, sized=False)
    collectives._all_gather = record("all_gather", collectives._all_gather)
    collectives._reduce_scatter = record("reduce_scatter", collectives._reduce_scatter)
    return calls


def _roles(calls: list[tuple], ddp: wholeshard.DataParallel) -> list[Call]:
    """Each call's group by its roles ("dp+shard+gather"): the same on every rank, unlike a
    shard group's ranks."""
    roles = {
        "dp": ddp.process_group or dist.group.WORLD,
        "shard": ddp.shard_group or dist.group.WORLD,
        "replica": ddp.replica_group,
        "gather": ddp.gather_group or dist.group.WORLD,
    }
    out = []
    for op, group, numel, dtype in calls:
        names = "+".join(name for name, g in roles.items() if g is group) or "other"
        out.append((op, names, numel, dtype))
    return out


def _steps(ddp_kw: dict, recipe: str | None, unchecked: bool) -> list[Call]:
    """`unchecked`: `nonfinite=None` and no clipping, so no step collective waits for the
    reductions (a pipelined step then dispatches the rest before its check)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Branchy()
    if recipe is not None:
        model = fp8.convert(model, recipe)
    calls = _recording()
    ddp = data_parallel(model, bucket_size=3000, **ddp_kw)
    nonfinite = None if unchecked else "error"
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW, nonfinite=nonfinite)
    for step in range(4):
        model.skip = step in (1, 3) and rank == 1  # the middle block: rank 0 only
        model.recompute = step >= 2
        x, y = local_batch(step, rank, world)
        loss = nn.functional.cross_entropy(ddp(x).float().reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        if not unchecked:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation between steps
            ddp(x)
    ddp.free_overlap_buffers()
    return _roles(calls, ddp)


FULLY_SHARDED = dict(reshard_after_forward=True)
MODES = {
    "overlap": (OVERLAP, None, False),
    "pipelined": (dict(pipelined_step=True, **OVERLAP), None, False),
    "pipelined-unchecked": (dict(pipelined_step=True, **OVERLAP), None, True),
    "pipelined-unchecked-one-group": (
        dict(pipelined_step=True, separate_all_gather_group=False, **OVERLAP),
        None,
        True,
    ),
    "fully-sharded-overlap": (dict(FULLY_SHARDED, **OVERLAP), None, False),
    "pipelined-fully-sharded": (dict(pipelined_step=True, **FULLY_SHARDED, **OVERLAP), None, False),
    "pipelined-fully-sharded-unchecked": (
        dict(pipelined_step=True, **FULLY_SHARDED, **OVERLAP),
        None,
        True,
    ),
    "shard-groups": (dict(shard_group_size=2, **OVERLAP), None, False),
    "fp8-gather": (
        dict(fp8_param_gather=True, mp_policy=mp(torch.bfloat16), **OVERLAP),
        "mxfp8",
        False,
    ),
    "owners-pipelined-fully-sharded": (
        dict(strategy="owners", pipelined_step=True, **FULLY_SHARDED, **OVERLAP),
        None,
        False,
    ),
    "owners-pipelined-unchecked": (
        dict(strategy="owners", pipelined_step=True, **OVERLAP),
        None,
        True,
    ),
    "owners-fp8-gather": (
        dict(strategy="owners", fp8_param_gather=True, mp_policy=mp(torch.bfloat16), **OVERLAP),
        "tensorwise",
        False,
    ),
    "exchange-overlap": (dict(strategy="exchange", **OVERLAP), None, False),
    "exchange-pipelined-unchecked": (
        dict(strategy="exchange", pipelined_step=True, exchange_every=1, **OVERLAP),
        None,
        True,
    ),
    "exchange-shard-groups-sync": (
        dict(strategy="exchange", shard_group_size=2, overlap_grad_reduce=False),
        None,
        False,
    ),
    "exchange-pipelined-fully-sharded": (
        dict(strategy="exchange", pipelined_step=True, **FULLY_SHARDED, **OVERLAP),
        None,
        False,
    ),
    "exchange-fully-sharded-unchecked": (
        dict(strategy="exchange", exchange_every=1, **FULLY_SHARDED, **OVERLAP),
        None,
        True,
    ),
    "two-level-exchange-fully-sharded": (
        dict(strategy="exchange", node_size=2, **FULLY_SHARDED, **OVERLAP),
        None,
        False,
    ),
    "exchange-fp8-gather": (
        dict(strategy="exchange", fp8_param_gather=True, mp_policy=mp(torch.bfloat16), **OVERLAP),
        "tensorwise",
        False,
    ),
}


CORE = ("pipelined-fully-sharded", "shard-groups")  # the fast tier (`pytest -m core`)


@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=pytest.mark.core) if m in CORE else m for m in MODES]
)
def test_every_rank_issues_the_same_collectives_in_the_same_order(mode: str) -> None:
    ddp_kw, recipe, unchecked = MODES[mode]
    world = 4 if "shard_group_size" in ddp_kw or "node_size" in ddp_kw else 2
    seqs = run_detail(_steps, world, ddp_kw, recipe, unchecked)
    assert len(seqs[0]) > 20  # construction, 4 steps and evaluations all issue collectives
    if "exchange" in mode:  # not vacuous
        assert any(call[0] == "all_to_all" for call in seqs[0])
    for rank, seq in enumerate(seqs[1:], start=1):
        for i, (a, b) in enumerate(zip(seqs[0], seq, strict=False)):
            assert a == b, f"collective #{i}: rank 0 issues {a}, rank {rank} issues {b}"
        assert len(seq) == len(seqs[0]), (
            f"rank {rank}: {len(seq)} collectives, rank 0 {len(seqs[0])}"
        )


def _two_groups(inverted: bool) -> float:
    """An all-reduce on the default group and one on another group of the same ranks, issued
    by rank 1 in the inverted order where `inverted`."""
    other = dist.new_group(list(range(dist.get_world_size())))
    a, b = torch.ones(4), torch.ones(8)
    calls = [(a, None), (b, other)]
    if inverted and dist.get_rank() == 1:
        calls.reverse()
    for work in [dist.all_reduce(t, group=g, async_op=True) for t, g in calls]:
        work.wait()
    return (a.sum() + b.sum()).item()


def test_detail_fails_an_order_inverted_across_groups_that_gloo_forgives() -> None:
    """What `run_detail` guards against: gloo runs two groups independently, so it completes an
    order NCCL can hang on; under DETAIL the same order raises once the collective times out."""
    both = 2 * 4 + 2 * 8
    assert launch(_two_groups, 2, (True,), start_method="fork", timeout=60) == [both, both]
    assert launch(_two_groups, 2, (False,), start_method="fork", timeout=60, env=DETAIL) == [
        both,
        both,
    ]
    with pytest.raises(WorkerFailed, match="failed to pass monitoredBarrier"):
        launch(
            _two_groups, 2, (True,), start_method="fork", timeout=60, collective_timeout_s=2,
            env=DETAIL,
        )  # fmt: skip
