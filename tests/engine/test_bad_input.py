"""Bad input gets a clear error on every rank: never a hang, never silent wrong training."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from support import ADAMW_KW, MUON_KW, TinyLM, lm_loss, local_batch, make_model, run
from torch import nn

import wholeshard
from wholeshard.distributed.launch import WorkerFailed, launch


def _build_with_rank_dependent_model(differ: str) -> str:
    rank = dist.get_rank()
    torch.manual_seed(0)
    if differ == "shape" and rank == 1:
        model = TinyLM(layers=2)
        model.blocks[1].fc = nn.Linear(32, 64)  # 4*dim elsewhere
        model.blocks[1].out = nn.Linear(64, 32)
    elif differ == "order" and rank == 2:
        model = TinyLM()
        del model.ln
        model.ln = nn.LayerNorm(32)  # same names and shapes, registered after the head
    elif differ == "dtype" and rank == 1:
        model = TinyLM().double()
    else:
        model = TinyLM()
    try:
        wholeshard.DataParallel(model)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("differ", ["shape", "order", "dtype"])
def test_ranks_with_different_models_all_raise(differ: str) -> None:
    messages = run(_build_with_rank_dependent_model, 3, differ)
    assert len(set(messages)) == 1, "every rank raises the same error"
    assert "ranks built different models" in messages[0]
    assert "rank 0" in messages[0]


def test_no_param_routed_to_muon() -> None:
    with pytest.raises(ValueError, match="no parameter is routed to Muon") as e:
        wholeshard.DataParallel(make_model(), matrix_params=lambda name, p: False)
    assert "blocks.0.qkv.weight" in str(e.value), "the message carries the routing table"


def test_muon_param_must_have_2_dims() -> None:
    with pytest.raises(ValueError, match="fewer than 2 dims.*matrix_params") as e:
        wholeshard.DataParallel(make_model(), matrix_params=lambda name, p: True)
    assert "ln.weight" in str(e.value)


def test_default_routing() -> None:
    routes = {r.name: r for r in wholeshard.route_params(make_model(tied=True))}
    assert routes["blocks.0.qkv.weight"].matrix
    assert not routes["blocks.0.fc.bias"].matrix
    assert not routes["emb.weight"].matrix and routes["emb.weight"].tied
    assert "head.weight" not in routes, "a tied param is routed once, under its first name"
    assert not routes["pos"].matrix
    untied = {r.name: r for r in wholeshard.route_params(make_model())}
    # the output head is AdamW's, tied or not
    assert not untied["head.weight"].matrix and not untied["head.weight"].tied


def test_process_group_not_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        wholeshard.DataParallel(make_model())


def test_frozen_params_are_left_out() -> None:
    model = make_model()
    model.emb.weight.requires_grad_(False)
    before = model.emb.weight.detach().clone()
    ddp = wholeshard.DataParallel(model)
    assert "emb.weight" not in {r.name for r in ddp.routes}
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    lm_loss(ddp, *local_batch(0, 0, 1)).backward()
    opt.step()
    assert torch.equal(model.emb.weight, before)


def _train_with_unused_param() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    model.unused = nn.Linear(32, 32)  # never called in forward
    before = model.unused.weight.detach().clone()
    ddp = wholeshard.DataParallel(model)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    for step in range(3):
        lm_loss(ddp, *local_batch(step, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    return {"before": before, "after": model.unused.weight.detach().clone()}


def test_param_without_gradient_is_not_stepped() -> None:
    for out in run(_train_with_unused_param, 2):
        # No gradient on any rank: not stepped, not even weight decay (as torch.optim.Muon).
        assert torch.equal(out["after"], out["before"])


def _backward_twice_without_zero_grad() -> None:
    model = make_model()
    ddp = wholeshard.DataParallel(model)
    lm_loss(ddp, *local_batch(0, dist.get_rank(), 2)).backward()
    ddp.step_protocol.finish_grad_sync()
    lm_loss(ddp, *local_batch(1, dist.get_rank(), 2)).backward()


def test_backward_after_grad_sync_without_zero_grad_raises() -> None:
    with pytest.raises(WorkerFailed, match="call optimizer.zero_grad"):
        run(_backward_twice_without_zero_grad, 2)


def _fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever without the launcher
    return 0


def test_launcher_reports_the_failing_rank_and_stops_the_rest() -> None:
    with pytest.raises(WorkerFailed) as e:
        launch(_fail_on_rank_one, 2, start_method="fork", timeout=60)
    assert e.value.rank == 1
    assert "boom on purpose" in e.value.traceback


def test_launcher_reports_a_worker_that_cannot_start() -> None:
    """A spawn that fails (here: a function pickle cannot send) raises its own error, not one
    from stopping the workers that never started."""
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        launch(lambda: 1, 2, start_method="spawn", timeout=60)
