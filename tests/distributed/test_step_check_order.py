"""Every rank issues the step check after the last reduction of its step, whichever units its
backward completed ([Note: step check order] in `wholeshard/optim/_step_check.py`).

An MoE whose experts run only for the tokens that chose them; rank 0's tokens never choose
expert 1, so a unit holding expert 1's params completes in backward on rank 1 only, and its
reduction leaves there during backward but on rank 0 only at the step. With `pipelined_step`,
`overlap_grad_reduce` and `nonfinite=None` the step check was issued before those reductions
on rank 0 and after them on rank 1: on the all-gather group an order NCCL hangs on, on one group
a mismatch even gloo fails on. Every run here is under `TORCH_DISTRIBUTED_DEBUG=DETAIL`
(`run_detail`), which blocks on such an order as NCCL does; each matches one process running
torch's Muon and AdamW on the same per-rank losses, and the pipelined runs equal the synchronous
one bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from moe_support import MoELM
from support import (
    ADAMW_KW,
    MUON_KW,
    TOL,
    data_parallel,
    full_params,
    lm_loss,
    local_batch,
    reference_run,
    run_detail,
)

import wholeshard

WORLD, STEPS, SKIPPED, BUCKET = 2, 3, 1, 2000  # small buckets: the experts in several units


def moe(rank: int) -> MoELM:
    """The MoE as `rank` runs it: on rank 0 no token chooses expert `SKIPPED`."""
    model = MoELM("modules")
    model.moe.unused = SKIPPED if rank == 0 else None
    return model


def local_loss(model: MoELM, step: int, rank: int) -> torch.Tensor:
    model.moe.unused = SKIPPED if rank == 0 else None
    return lm_loss(model, *local_batch(step, rank, WORLD))


def reference() -> dict[str, torch.Tensor]:
    """One process, torch's Muon and AdamW, on the mean of the ranks' losses."""

    def loss_of(model: MoELM, step: int) -> torch.Tensor:
        return sum(local_loss(model, step, r) for r in range(WORLD)) / WORLD

    return reference_run(STEPS, make=lambda: moe(0), loss_of=loss_of)["params"]


def worker(ddp_kw: dict) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    model = moe(rank)
    ddp = data_parallel(model, bucket_size=BUCKET, **ddp_kw)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW, nonfinite=None)
    for step in range(STEPS):
        local_loss(ddp.module, step, rank).backward()
        opt.step()
        opt.zero_grad()
    with ddp.full_params():
        return full_params(model)


PIPELINED = dict(pipelined_step=True, overlap_grad_reduce=True)
MODES = {
    "sync": dict(overlap_grad_reduce=False),
    "pipelined": PIPELINED,  # the check on the separate all-gather group
    "pipelined-one-group": dict(PIPELINED, separate_all_gather_group=False),
}


@pytest.mark.parametrize("strategy", ["balanced", "owners"])
def test_a_pipelined_unchecked_step_orders_the_check_after_the_reductions(strategy: str) -> None:
    ref = reference()
    initial = full_params(moe(0))
    expert = f"moe.experts.{SKIPPED}.up.weight"
    assert not torch.equal(ref[expert], initial[expert]), "rank 1's tokens reach the expert"
    outs = {m: run_detail(worker, WORLD, dict(kw, strategy=strategy)) for m, kw in MODES.items()}
    tol = TOL[torch.float32]
    for mode, per_rank in outs.items():
        for out in per_rank:
            for name, want in ref.items():
                assert torch.allclose(out[name], want, atol=tol["atol"], rtol=0), (mode, name)
                assert torch.equal(out[name], outs["sync"][0][name]), (mode, name)
