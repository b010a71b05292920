"""What a user with torch habits does to a wrapped model: each either works as in torch or raises
a clear error, never a silent divergence (issue: what a new user hit)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support import (
    ADAMW_KW,
    MUON_KW,
    OVERLAP,
    data_parallel,
    lm_loss,
    local_batch,
    make_model,
    mp,
    run,
    train_steps,
)
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import wholeshard


def _state_dict_after_overlapped_step() -> dict:
    rank = dist.get_rank()
    ddp = data_parallel(make_model(), bucket_size=3000, **OVERLAP)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    train_steps(ddp, opt, range(2))
    with pytest.raises(RuntimeError, match="finish_param_sync"):
        ddp.module.state_dict()  # the torch habit: would be stale, different on each rank
    if rank == 0:  # a rank reading alone gets the same error, and nothing hangs
        with pytest.raises(RuntimeError, match="not gathered yet"):
            ddp.state_dict()
    ddp.finish_param_sync()
    saved = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    with ddp.full_params():
        current = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    return {"saved": saved, "current": current}


def test_state_dict_after_an_overlapped_step_is_never_stale() -> None:
    outs = run(_state_dict_after_overlapped_step, 2)
    for out in outs:
        for k, v in out["current"].items():
            assert torch.equal(out["saved"][k], v), k
    for k, v in outs[0]["saved"].items():
        assert torch.equal(outs[1]["saved"][k], v), f"{k} differs across ranks"


def test_torch_optimizer_over_wrapped_params_raises() -> None:
    ddp = wholeshard.DataParallel(make_model())
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    lm_loss(ddp, *local_batch(0, 0, 1)).backward()
    with pytest.raises(RuntimeError, match="LayerwiseOptimizer.*owns the step"):
        sgd.step()
    assert sgd.state == {} or all(not s for s in sgd.state.values())
    with pytest.raises(RuntimeError, match="LayerwiseOptimizer.*a torch optimizer"):
        lm_loss(ddp, *local_batch(1, 0, 1)).backward()  # the "backward twice" error says why


def test_torch_optimizer_over_unwrapped_params_is_untouched() -> None:
    ddp = wholeshard.DataParallel(make_model())
    other = nn.Linear(4, 4)
    before = other.weight.detach().clone()
    other(torch.ones(1, 4)).sum().backward()
    torch.optim.SGD(other.parameters(), lr=0.1).step()  # the guard is for wrapped params only
    assert not torch.equal(other.weight, before)
    wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW).step()


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x))) * scale


def test_param_dtype_casts_floating_forward_inputs() -> None:
    ddp = wholeshard.DataParallel(Regressor(), mp_policy=mp(torch.bfloat16))
    x, scale = torch.randn(4, 8), torch.tensor(2.0)
    y = ddp(x, scale=scale)  # float32 inputs, bf16 model: cast, as FSDP2 does
    assert y.dtype == torch.bfloat16
    lm = wholeshard.DataParallel(make_model(), mp_policy=mp(torch.bfloat16))
    assert lm(local_batch(0, 0, 1)[0]).dtype == torch.bfloat16  # token ids are left alone
    uncast = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    plain = wholeshard.DataParallel(Regressor(), mp_policy=uncast)
    with pytest.raises(RuntimeError, match="dtype"):
        plain(x, scale=scale)


def test_wrapping_a_module_twice_is_refused_and_release_gives_it_back() -> None:
    model = make_model()
    ddp = wholeshard.DataParallel(model)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    train_steps(ddp, opt, range(2))
    with pytest.raises(ValueError, match=r"already wrapped.*ddp\.release\(\)"):
        wholeshard.DataParallel(model)
    with pytest.raises(ValueError, match="already wrapped"):
        wholeshard.DataParallel(model.blocks[0])  # a part of it too
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert ddp.release() is model
    for k, v in model.state_dict().items():  # its values, in storage of its own
        assert torch.equal(v, trained[k]), k
    assert all(p.grad is None for p in model.parameters())

    model.blocks[0].requires_grad_(False)  # progressive freezing, then wrap again
    frozen = model.blocks[0].fc.weight.detach().clone()
    again = wholeshard.DataParallel(model)
    opt = wholeshard.LayerwiseOptimizer(again, matrix=MUON_KW, adamw=ADAMW_KW)
    train_steps(again, opt, range(2, 4))
    assert torch.equal(model.blocks[0].fc.weight, frozen)
    assert not torch.equal(model.blocks[1].fc.weight, trained["blocks.1.fc.weight"])
