"""Pipeline stages: each stage of a `torch.distributed.pipelining` schedule wrapped by
`DataParallel` on its stage's data-parallel group trains like the unpipelined model.

pp 2 x dp 2 on 4 gloo ranks (mesh dims `("pp", "dp")`), GPipe and 1F1B with 4 micro-batches,
against one process stepping the whole model on the full batch (torch Muon + AdamW). Every
micro-batch's backward runs under `ddp.no_sync()`, so gradients accumulate locally and are
reduced once, at `optimizer.step()`; the loss is divided by the micro-batch count
(`scale_grads=False`: torch's own scaling divides `.grad`, which stays None under wholeshard).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import ADAMW_KW, MUON_KW, TOL, data_parallel
from support import run as launch_run
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import wholeshard

STEPS, MICRO, BATCH, SPLIT = 3, 4, 32, 4  # SPLIT: the first stage's Sequential layers


def make_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
        nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8),
    )  # fmt: skip


def matrices(name: str, param: torch.Tensor) -> bool:
    return param.ndim == 2  # every weight to Muon, every bias to AdamW, in stages and whole


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 8, generator=g)


def reference() -> dict[str, torch.Tensor]:
    model = make_mlp()
    muon = [p for n, p in model.named_parameters() if matrices(n, p)]
    other = [p for n, p in model.named_parameters() if not matrices(n, p)]
    opts = [torch.optim.Muon(muon, **MUON_KW), torch.optim.AdamW(other, **ADAMW_KW)]
    for step in range(STEPS):
        x, y = data(step)
        F.mse_loss(model(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def pipelined(schedule_cls, ddp_kw: dict) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    model = make_mlp()
    stage_module = model[:SPLIT] if stage_index == 0 else model[SPLIT:]  # keeps the names
    ddp = data_parallel(stage_module, mesh=mesh, matrix_params=matrices, **ddp_kw)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    stage = PipelineStage(ddp, stage_index, 2, torch.device("cpu"), group=mesh.get_group("pp"))

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target) / MICRO

    schedule = schedule_cls(stage, n_microbatches=MICRO, loss_fn=loss_fn, scale_grads=False)
    rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
    for step in range(STEPS):
        x, y = data(step)
        with ddp.no_sync():  # accumulate every micro-batch; reduce once, at the step
            if stage_index == 0:
                schedule.step(x[rows])
            else:
                schedule.step(target=y[rows])
        opt.step()
        opt.zero_grad()
    with ddp.full_params():
        return {n: p.detach().clone() for n, p in stage_module.named_parameters()}


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MODES = {
    "zero": {},
    "fully_sharded_overlap": dict(
        reshard_after_forward=True, overlap_grad_reduce=True, overlap_param_gather=True
    ),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_pp2_dp2_trains_like_the_whole_model(schedule: str, mode: str) -> None:
    outs = launch_run(pipelined, 4, SCHEDULES[schedule], MODES[mode])
    ref = reference()
    assert outs[0] == outs[0] and set(outs[0]) | set(outs[2]) == set(ref)
    tol = TOL[torch.float32]
    worst = 0.0
    for rank, out in enumerate(outs):
        peer = outs[rank ^ 1]  # the other dp rank of the same stage: the same bits
        for name, got in out.items():
            assert torch.equal(got, peer[name]), name
            assert torch.allclose(got, ref[name], atol=tol["atol"], rtol=0), name
            worst = max(worst, (got - ref[name]).abs().max().item())
    print(f"{schedule} {mode}: max |param diff| vs one process {worst:.3g}")


def _without_no_sync() -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index = mesh.get_local_rank("pp")
    model = make_mlp()
    ddp = wholeshard.DataParallel(model[:SPLIT] if stage_index == 0 else model[SPLIT:], mesh=mesh)
    stage = PipelineStage(ddp, stage_index, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=F.mse_loss, scale_grads=False)
    x, y = data(0)
    try:
        schedule.step(x[:16]) if stage_index == 0 else schedule.step(target=y[:16])
    except RuntimeError as e:
        return f"{e} <- {e.__cause__}"  # the pipeline wraps the stage's error
    return "accepted"


def test_micro_batches_outside_no_sync_are_refused() -> None:
    """The second micro-batch's gradient would land on a bucket already counted: the last
    stage's ranks, whose backward runs first, raise naming `ddp.no_sync()` (the first stage's
    then lose their peer)."""
    said = launch_run(_without_no_sync, 4)
    assert all(
        "wrap all but the last micro-batch's backward in ddp.no_sync()" in s for s in said[2:]
    ), said
