"""Misuse of the Python API raises, on every rank, with a message that says what to do."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support import lm_loss, local_batch, make_model, run
from torch import nn

import wholeshard


def _wrap(model: nn.Module) -> str:
    try:
        wholeshard.DataParallel(model)
    except ValueError as e:
        return str(e)
    return "no error"


def _meta_on_rank_one() -> str:
    model = make_model()
    if dist.get_rank() == 1:
        model.blocks[0].fc.weight = nn.Parameter(torch.empty(128, 32, device="meta"))
    return _wrap(model)


def test_a_meta_param_on_one_rank_raises_on_every_rank() -> None:
    messages = run(_meta_on_rank_one, 2)
    assert messages[0] == messages[1]
    assert "rank 1" in messages[0]
    assert "'blocks.0.fc.weight' is on the meta device" in messages[0]
    assert "to_empty" in messages[0]


def test_a_meta_buffer_raises() -> None:
    model = make_model()
    model.register_buffer("table", torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="'table' is on the meta device"):
        wholeshard.DataParallel(model)


def test_a_non_contiguous_param_raises() -> None:
    model = make_model()
    model.blocks[1].out.weight = nn.Parameter(torch.randn(32, 128).T.contiguous().T)
    with pytest.raises(ValueError, match="'blocks.1.out.weight' is not contiguous.*contiguous"):
        wholeshard.DataParallel(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_params_on_two_devices_raise() -> None:
    model = make_model()
    model.head.cuda()
    with pytest.raises(ValueError, match="several devices.*'head.weight' on cuda"):
        wholeshard.DataParallel(model)


def _backward_twice(overlap: bool) -> str:
    ddp = wholeshard.DataParallel(make_model(), overlap_grad_reduce=overlap)
    rank = dist.get_rank()
    lm_loss(ddp, *local_batch(0, rank, 2)).backward()
    try:
        lm_loss(ddp, *local_batch(1, rank, 2)).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("overlap", [False, True])
def test_backward_twice_without_step_raises(overlap: bool) -> None:
    messages = run(_backward_twice, 2, overlap)
    for m in messages:
        assert "no_sync" in m and "zero_grad" in m, m


def test_backward_twice_inside_no_sync_accumulates() -> None:
    ddp = wholeshard.DataParallel(make_model())
    with ddp.no_sync():
        lm_loss(ddp, *local_batch(0, 0, 1)).backward()
        lm_loss(ddp, *local_batch(1, 0, 1)).backward()
    lm_loss(ddp, *local_batch(2, 0, 1)).backward()
    ddp.finish_grad_sync()


def _head_frozen(model: nn.Module) -> None:
    model.head.weight.requires_grad_(False)


def _ln_replaced(model: nn.Module) -> None:
    model.ln.weight = nn.Parameter(torch.ones(32))


def _module_added(model: nn.Module) -> None:
    model.extra = nn.Linear(32, 32)


def _module_removed(model: nn.Module) -> None:
    del model.blocks[1]


@pytest.mark.parametrize(
    "change, what",
    [
        (_head_frozen, "'head.weight' has requires_grad=False, True when it was wrapped"),
        (_ln_replaced, "'ln.weight' was replaced by a new Parameter"),
        (_module_added, "'extra.weight' was added"),
        (_module_removed, "'blocks.1.ln1.weight' was removed"),
    ],
)
def test_model_changes_after_wrapping_are_named(change, what: str) -> None:
    model = make_model()
    ddp = wholeshard.DataParallel(model)
    assert ddp.model_changes() is None
    change(model)
    message = ddp.model_changes()
    assert message is not None and what in message, message
    assert "before wrapping" in message
