"""A rank that dies or stalls mid-step never hangs the others: they fail with a message naming
the collective, within the collective timeout."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from support import data_parallel, lm_loss, local_batch, make_model

import wholeshard
from wholeshard.distributed.groups import group_timeout
from wholeshard.distributed.launch import WorkerFailed, launch

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 15  # short, yet longer than a busy machine's start-up skew between ranks

# Runs `wholeshard train` as one torchrun-launched rank; rank VICTIM kills itself with SIGKILL
# in the middle of step KILL_STEP's backward (when the gradient reaches the middle block).
RANK_SCRIPT = """
import os, signal, sys, torch
from wholeshard import cli
from wholeshard.models.gpt import GPT

VICTIM, KILL_STEP = int(sys.argv[1]), int(sys.argv[2])
forward, steps = GPT.forward, [0]

def kill(grad):
    os.kill(os.getpid(), signal.SIGKILL)

def arm(module, args, out):
    out.register_hook(kill)

def forward_then_arm(self, idx):
    if torch.is_grad_enabled():
        steps[0] += 1
        if steps[0] == KILL_STEP and int(os.environ["RANK"]) == VICTIM:
            middle = self.blocks[len(self.blocks) // 2]
            middle.register_forward_hook(arm)
    return forward(self, idx)

GPT.forward = forward_then_arm
sys.exit(cli.main(sys.argv[3:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "mode, collective",
    [
        pytest.param([], "grad sync", id="sync"),
        pytest.param(
            ["--overlap", "--reshard-after-forward"],
            "sync",
            id="overlap-fully-sharded",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_survivors_exit_when_a_rank_is_killed_mid_step(
    tmp_path: Path, mode: list[str], collective: str
) -> None:
    world, victim, kill_step = 3, 1, 3
    text = tmp_path / "text.py"
    text.write_bytes((ROOT / "wholeshard" / "train" / "trainer.py").read_bytes() * 2)
    argv = [
        "train", "--model", "micro", "--data", str(text), "--out", str(tmp_path / "out"),
        "--steps", "50",
        "--batch-size", "6", "--seq-len", "16", "--eval-every", "50", "--eval-batches", "1",
        "--no-progress", "--param-dtype", "float32", "--collective-timeout", str(TIMEOUT_S),
        *mode,
    ]  # fmt: skip
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            PYTHONPATH=str(ROOT),
            OMP_NUM_THREADS="1",
        )
        cmd = [sys.executable, "-c", RANK_SCRIPT, str(victim), str(kill_step), *argv]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        code = procs[victim].wait(timeout=600)
        assert code == -signal.SIGKILL, procs[victim].stderr.read()
        deadline = time.monotonic() + TIMEOUT_S + 10
        for rank, p in enumerate(procs):
            if rank == victim:
                continue
            p.wait(timeout=max(0.1, deadline - time.monotonic()))  # raises if it hangs
            err = p.stderr.read()
            assert p.returncode == 1, err
            assert "a peer rank likely died" in err, err
            # The first collective to notice: one of the step's, or the loss's all-reduce
            # (issued before backward, read after it).
            named = collective in err and "of unit" in err
            assert named or "the all-reduce of the loss failed" in err, err
            assert "Traceback" not in err, err
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()
            p.stderr.close()


STALL_S = 5


def _stop_in_backward(module, args, out) -> None:
    out.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGSTOP))


def _stall_rank_three_mid_backward() -> None:
    """World 4, shard groups of 2: every collective of a step runs on a subgroup."""
    model = make_model(layers=4)
    ddp = data_parallel(model, shard_group_size=2, separate_all_gather_group=True)
    for g in (ddp.shard_group, ddp.replica_group, ddp.gather_group):
        assert group_timeout(g) == timedelta(seconds=STALL_S)  # inherited from the world group
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=dict(lr=0.01), adamw=dict(lr=0.01))
    rank = dist.get_rank()
    for step in range(3):
        if step == 2 and rank == 3:
            model.blocks[1].register_forward_hook(_stop_in_backward)
        lm_loss(ddp, *local_batch(step, rank, 4)).backward()
        opt.step()
        opt.zero_grad()


def test_a_stalled_rank_times_out_the_others_on_every_subgroup() -> None:
    with pytest.raises(WorkerFailed) as failed:
        launch(
            _stall_rank_three_mid_backward,
            4,
            start_method="fork",
            timeout=120,  # a hang (a group without the timeout) fails here instead
            collective_timeout_s=STALL_S,
        )
    assert failed.value.rank != 3
    text = failed.value.traceback
    assert "CollectiveError" in text and "a peer rank likely died or stalled" in text, text
    # gloo says "Timed out waiting ...ms" or "Application timeout caused pair closure"
    assert "of unit" in text and re.search(r"time[sd]? ?out", text, re.IGNORECASE), text


def _abort_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os.abort()  # what NCCL's watchdog does to a rank whose collective timed out
    dist.barrier()


def test_an_aborted_rank_is_named_with_the_nccl_watchdog_hint() -> None:
    with pytest.raises(WorkerFailed) as failed:
        launch(_abort_on_rank_1, 2, start_method="fork", timeout=60, collective_timeout_s=10)
    assert failed.value.rank == 1
    text = str(failed.value)
    assert "was killed by SIGABRT" in text and "Watchdog caught collective operation" in text
