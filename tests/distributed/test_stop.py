"""A request to stop ([Note: stopping at a step]): the launcher forwards the one made in its
process to every worker, a launch whose workers stopped where they were asked raises
KeyboardInterrupt, and the ranks agree on the request in the loss's all-reduce.
(`tests/train/test_train_interrupt.py` runs the whole Ctrl-C.)"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from support import run

from wholeshard.distributed import stop
from wholeshard.distributed.launch import launch
from wholeshard.train.env import DistEnv, GlobalMean

WAIT_S = 60


@pytest.fixture
def asked() -> Iterator[None]:
    """A stop requested in this process, before any worker starts (a forked worker inherits
    the request, which `stop.listen` forgets: what it sees comes from the launcher)."""
    stop.request()
    try:
        yield
    finally:
        stop.withdraw()


def _joined() -> None:
    """Every rank has joined the group: a rank that exits at once could close its connection
    while a peer still sets up the group's ("Connection closed by peer")."""
    dist.barrier()


def _stop_when_asked() -> int:
    _joined()
    deadline = time.monotonic() + WAIT_S
    while not stop.requested():
        assert time.monotonic() < deadline, "the launcher never forwarded the request"
        time.sleep(0.01)
    raise KeyboardInterrupt


def _finish() -> int:
    _joined()
    return int(os.environ["RANK"])


def _requested() -> bool:
    _joined()
    return stop.requested()


def test_the_request_reaches_every_worker_and_the_launch_ends_interrupted(asked) -> None:
    with pytest.raises(KeyboardInterrupt):
        launch(_stop_when_asked, 2, start_method="fork", timeout=WAIT_S + 30)


def test_workers_that_finish_anyway_return_their_values(asked) -> None:
    assert launch(_finish, 2, start_method="fork", timeout=60) == [0, 1]


def test_a_worker_sees_no_request_of_its_own() -> None:
    assert launch(_requested, 2, start_method="fork", timeout=60) == [False, False]


def _mean_and_flag(asked_ranks: tuple[int, ...]) -> tuple[float, bool]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    env = DistEnv(rank, world, world, torch.device("cpu"), False)
    mean = GlobalMean(torch.tensor(float(rank + 1)), env, flag=rank in asked_ranks)
    return mean.value(), mean.flagged()


@pytest.mark.parametrize("asked_ranks", [(), (1,), (0, 1)])
def test_the_ranks_agree_on_the_request_in_the_losss_all_reduce(asked_ranks) -> None:
    expected = (1.5, bool(asked_ranks))
    assert run(_mean_and_flag, 2, asked_ranks) == [expected, expected]
