"""Which device a model may be on for its collectives (`_guard.device_problem`): NCCL runs on the
current CUDA device, so a model elsewhere, or every rank of a node on GPU 0 (the forgotten
`torch.cuda.set_device(LOCAL_RANK)`), is refused with the fix, before any collective."""

from __future__ import annotations

import pytest
import torch

from wholeshard.engine._guard import device_problem

CUDA = torch.device("cuda", 0)
OK = dict(backend="nccl", current=0, bound=None, local_rank=0, local_world=1, visible=1)


@pytest.mark.parametrize(
    ("device", "change", "message"),
    [
        (torch.device("cuda", 1), {}, "on cuda:1 but the current CUDA device is cuda:0"),
        (CUDA, dict(bound=torch.device("cuda", 1)), "bound to cuda:1"),
        (CUDA, dict(local_rank=3, local_world=8, visible=8), "local rank 3 of 8 is on cuda:0"),
    ],
)
def test_nccl_refuses_a_device_it_cannot_use(device, change: dict, message: str) -> None:
    problem = device_problem(device, **(OK | change))
    assert problem is not None and message in problem
    assert "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))" in problem


@pytest.mark.parametrize(
    ("device", "change"),
    [
        (CUDA, {}),
        (torch.device("cuda", 3), dict(current=3, local_rank=3, local_world=8, visible=8)),
        (CUDA, dict(local_rank=3, local_world=8, visible=1)),  # CUDA_VISIBLE_DEVICES per rank
        (CUDA, dict(bound=CUDA)),
        (torch.device("cuda", 1), dict(backend="gloo")),  # gloo takes tensors on any device
        (torch.device("cpu"), {}),
    ],
)
def test_devices_nccl_can_use_pass(device, change: dict) -> None:
    assert device_problem(device, **(OK | change)) is None
