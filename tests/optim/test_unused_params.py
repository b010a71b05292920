"""A param that gets no gradient is not stepped, as torch's optimizers skip a param whose `.grad`
is None; one used on some ranks only is stepped on the average, zeros counting for the others.

The model is two `Linear(32, 32)` in a row. Step 0 uses both on every rank; step 1 skips the
second on every rank (it must not move: no momentum, no weight decay); step 2 uses it on rank 0
only; step 3 is `zero_grad(); step()` with no backward (nothing moves). The reference is one
process running `torch.optim.Muon` + `torch.optim.AdamW` on the loss averaged over the ranks'
batches. Every mode runs under `TORCH_DISTRIBUTED_DEBUG=DETAIL` (`run_detail`), which blocks as
NCCL does where the ranks' collectives differ in order, even across groups.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support import ADAMW_KW, MUON_KW, OVERLAP, data_parallel, run_detail
from torch import nn

import wholeshard

WORLD, DIM, ROWS = 2, 32, 4
STEPS = 4
FIRST = "first.weight", "first.bias"
SECOND = "second.weight", "second.bias"


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(DIM, DIM)
        self.second = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, use_second: bool) -> torch.Tensor:
        h = self.first(x)
        return self.second(h) if use_second else h


def uses_second(step: int, rank: int) -> bool:
    return step == 0 or (step == 2 and rank == 0)


def local_loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(100 * step + rank))
    return model(x, uses_second(step, rank)).pow(2).mean()


def reference() -> list[dict[str, torch.Tensor]]:
    model = TwoLinear()
    params = dict(model.named_parameters())
    muon = torch.optim.Muon([p for p in params.values() if p.ndim == 2], **MUON_KW)
    adamw = torch.optim.AdamW([p for p in params.values() if p.ndim < 2], **ADAMW_KW)
    after = []
    for step in range(STEPS):
        muon.zero_grad()
        adamw.zero_grad()
        if step < STEPS - 1:
            loss = sum(local_loss(model, step, r) for r in range(WORLD)) / WORLD
            loss.backward()
        muon.step()
        adamw.step()
        after.append({k: v.detach().clone() for k, v in params.items()})
    return after


def worker(ddp_kw: dict, nonfinite: str | None) -> list[dict[str, torch.Tensor]]:
    rank = dist.get_rank()
    model = TwoLinear()
    ddp = data_parallel(model, **ddp_kw)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW, nonfinite=nonfinite)
    after = []
    for step in range(STEPS):
        opt.zero_grad()
        if step < STEPS - 1:
            local_loss(ddp, step, rank).backward()
        opt.step()
        with ddp.full_params():
            after.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return after


MODES = {
    "sync": (dict(), "error"),
    "overlap": (OVERLAP, "error"),
    "fully-sharded": (dict(reshard_after_forward=True, **OVERLAP), "error"),
    "pipelined": (dict(pipelined_step=True, **OVERLAP), "error"),
    "pipelined-unchecked": (dict(pipelined_step=True, overlap_grad_reduce=True), None),
    "shard-groups": (dict(shard_group_size=1, **OVERLAP), "error"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_unused_params_are_not_stepped(mode: str) -> None:
    ref = reference()
    # What the reference says, so that the test cannot pass on a model that never moves.
    for name in SECOND:
        assert torch.equal(ref[1][name], ref[0][name]), "skipped on every rank: untouched"
        assert not torch.equal(ref[2][name], ref[1][name]), "used on rank 0: stepped"
    assert not torch.equal(ref[1][FIRST[0]], ref[0][FIRST[0]])
    for name in FIRST + SECOND:
        assert torch.equal(ref[3][name], ref[2][name]), "no backward: nothing moves"

    ddp_kw, nonfinite = MODES[mode]
    for out in run_detail(worker, WORLD, ddp_kw, nonfinite):
        for step in range(STEPS):
            for name, want in ref[step].items():
                torch.testing.assert_close(out[step][name], want, msg=f"step {step}: {name}")
        for name in SECOND:  # not a bit of it moved while unused
            assert torch.equal(out[1][name], out[0][name]), name
        for name in FIRST + SECOND:
            assert torch.equal(out[3][name], out[2][name]), name
