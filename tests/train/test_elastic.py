"""A job that survives losing a node: torchrun's elastic mode with two agents on localhost as two
"nodes" (docs/operations.md's recipe), `wholeshard train --resume auto`.

- shrink: a 2-agent job loses one agent and its worker (SIGKILLed in the middle of the background
  save of a checkpoint) and finishes at world size 1 from the previous checkpoint;
- grow: a 1-agent job waits at a step until a second agent joins; torchrun restarts the worker
  and the job continues at world size 2 from the latest checkpoint.

Losses are compared with the uninterrupted run, one process (the same batches, split otherwise:
not bitwise, within `LOSS_RTOL`). Every agent carries a marker in its environment, which its
workers inherit: all are killed in `finally`, and every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_train_e2e import _env, _marked
from torch.distributed import TCPStore
from train_faults import metrics, train_job

from wholeshard.train import outputs

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ROOT / "tests" / "train" / "train_faults.py"
DEADLINE_S = 240  # a whole elastic job, generous on a loaded 2-core machine
STEPS = 16
HOST = "127.0.0.1"
LOSS_RTOL = 2e-3  # the same batches split otherwise: rounding apart (as test_train_tp's bound)

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")


def _train_args(text_file: Path, out: Path, *extra: str) -> list[str]:
    """The job: micro model, 4 x 16 tokens per step, checkpoints every 4 steps."""
    return [
        "train", "--model", "micro", "--data", str(text_file), "--out", str(out),
        "--steps", str(STEPS), "--batch-size", "4", "--seq-len", "16", "--eval-every", "4",
        "--eval-batches", "1", "--lr", "1e-2", "--newton-schulz", "torch_bf16", "--no-progress",
        "--threads", "1", "--checkpoint-every", "4", "--resume", "auto", *extra,
    ]  # fmt: skip


class Agents:
    """torchrun agents of one elastic job (`--nnodes=1:2`), each in its own session, its output
    in `log_dir`; `close()` kills what is left. The c10d rendezvous store is served here, on a
    port the system chose (the recipe's store outside the nodes: any agent may be lost)."""

    def __init__(self, log_dir: Path) -> None:
        self.store = TCPStore(HOST, 0, is_master=True, multi_tenant=True, wait_for_workers=False)
        self.log_dir, self.marker = log_dir, uuid.uuid4().hex
        self.procs: list[subprocess.Popen] = []

    def start(self, train_args: list[str], fault: str | None = None) -> subprocess.Popen:
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={HOST}:{self.store.port}",
            "--rdzv-conf=is_host=false,last_call_timeout=2,keep_alive_interval=1",
            "--max-restarts=3", "--monitor-interval=0.2",
        ]  # fmt: skip
        entry = ["-m", "wholeshard"] if fault is None else [str(FAULTS), fault]
        log = self.log_dir / f"agent{len(self.procs)}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(
                [*torchrun, *entry, *train_args],
                env=_env(self.marker, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def log(self, i: int) -> str:
        return (self.log_dir / f"agent{i}.log").read_text()

    def close(self) -> None:
        """SIGKILL every agent and worker of the job still alive, and reap the agents."""
        for pid in _marked(self.marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


@contextlib.contextmanager
def agents(log_dir: Path) -> Iterator[Agents]:
    job = Agents(log_dir)
    try:
        yield job
    finally:
        job.close()


def _wait(proc: subprocess.Popen, deadline: float) -> int:
    return proc.wait(max(1.0, deadline - time.monotonic()))


def _steps(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(out) if "event" not in r}


def _world_events(out: Path) -> list[dict]:
    return [r for r in metrics(out) if r.get("event") == "world_size"]


@pytest.fixture(scope="module")
def reference_run(text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run, single process (the full batch at once): its directory."""
    out = tmp_path_factory.mktemp("elastic") / "reference"
    assert train_job([*_train_args(text_file, out), "--nproc", "1"], out)["code"] == 0
    return out


@pytest.fixture(scope="module")
def reference(reference_run: Path) -> dict[int, dict]:
    """The uninterrupted run's step records, by step."""
    return _steps(reference_run)


def _check_losses(out: Path, reference: dict[int, dict]) -> None:
    """Every step logged once, with the global batch's tokens, its losses within `LOSS_RTOL`
    of the uninterrupted run's."""
    steps = _steps(out)
    assert sorted(steps) == sorted(reference) == list(range(STEPS + 1))
    for step, rec in steps.items():
        ref = reference[step]
        assert rec["tokens"] == ref["tokens"] == step * 4 * 16  # the global batch, unchanged
        for key in ("loss", "val_loss"):
            assert (key in rec) == (key in ref), (step, key)
            if key in ref:
                assert rec[key] == pytest.approx(ref[key], rel=LOSS_RTOL), (step, key)


def test_losing_a_node_mid_save_finishes_at_world_size_1(
    text_file: Path, tmp_path: Path, reference: dict[int, dict]
) -> None:
    """Two agents; the one whose worker is rank 1 and that worker are SIGKILLed while the
    background save of step 8 is in flight (every rank staged it, rank 1 wrote a file of it,
    training went on). The survivor's save fails, `latest` stays step-4, torchrun restarts it
    alone, and the job resumes from step 4 at world size 1 and finishes within the bound of the
    uninterrupted run."""
    out = tmp_path / "run"
    args = _train_args(text_file, out)
    with agents(tmp_path) as job:
        procs = [job.start(args, "1:8:node:in_flight") for _ in range(2)]
        deadline = time.monotonic() + DEADLINE_S
        codes = sorted(_wait(p, deadline) for p in procs)
        logs = job.log(0) + job.log(1)
    assert codes == [-signal.SIGKILL, 0], logs
    assert "the background save of checkpoint" in logs and "step-8 failed" in logs
    assert f"--resume auto: resumed from {out / 'checkpoints' / 'step-4'} at step 4" in logs
    assert (
        "world size 2 -> 1 (the checkpoint of step 4 was saved by 2 rank(s)); the global "
        "batch and its order are unchanged: 4 sequences per step = 1 rank x 4" in logs
    )
    [event] = _world_events(out)
    assert event["from"] == 2 and event["to"] == 1 and event["resume_step"] == 4
    assert event["first_step"] == 5 and event["last_logged_step"] >= 8
    assert event["per_rank"] == event["batch_size"] == 4 and event["accumulation"] == 1
    assert event["since_last_step_s"] > 0
    _check_losses(out, reference)
    summary = json.loads((out / outputs.SUMMARY).read_text())
    assert summary["world_size"] == 1 and summary["batch_size"] == 4


@pytest.mark.slow  # the shrink above covers torchrun's restart; the one below, growing to 2 ranks
def test_a_joining_node_grows_the_job_to_world_size_2(
    text_file: Path, tmp_path: Path, reference: dict[int, dict]
) -> None:
    """One agent runs the job alone and waits after step 9, once step 8 is checkpointed; a
    second agent joins, torchrun restarts the worker (a node waiting), and the job resumes from
    step 8 at world size 2 and finishes within the bound of the uninterrupted run."""
    out = tmp_path / "run"
    args = _train_args(text_file, out)
    latest = out / "checkpoints" / "latest"
    with agents(tmp_path) as job:
        first = job.start(args, "0:9:wait")
        deadline = time.monotonic() + DEADLINE_S
        while not (latest.exists() and latest.read_text().strip() == "step-8"):
            assert first.poll() is None and time.monotonic() < deadline, job.log(0)
            time.sleep(0.2)
        joined = time.time()
        second = job.start(args, "0:9:wait")
        codes = [_wait(p, deadline) for p in (first, second)]
        logs = job.log(0) + job.log(1)
    assert codes == [0, 0], logs
    assert f"--resume auto: resumed from {out / 'checkpoints' / 'step-8'} at step 8" in logs
    assert "world size 1 -> 2 (the checkpoint of step 8 was saved by 1 rank(s))" in logs
    [event] = _world_events(out)
    assert (event["from"], event["to"], event["resume_step"], event["first_step"]) == (1, 2, 8, 9)
    assert event["per_rank"] == 2 and event["batch_size"] == 4
    assert event["time"] > joined
    _check_losses(out, reference)
    assert json.loads((out / outputs.SUMMARY).read_text())["world_size"] == 2


@pytest.mark.slow  # resharding at load: tests/checkpoint; --resume auto at a new size: the shrink
def test_resuming_at_another_world_size_records_it(
    text_file: Path, tmp_path: Path, reference_run: Path, reference: dict[int, dict]
) -> None:
    """The grow without torchrun: the 1-rank run as it was at step 8 (its checkpoint of step 8
    `latest`, its records up to there) relaunched on 2 local ranks with `--resume auto`
    continues from step 8 at world size 2, says so in its header and `metrics.jsonl`, and stays
    within the bound."""
    out = tmp_path / "run"
    shutil.copytree(reference_run / "checkpoints" / "step-8", out / "checkpoints" / "step-8")
    (out / "checkpoints" / "latest").write_text("step-8")
    kept = [line for line in (reference_run / outputs.METRICS).read_text().splitlines()
            if json.loads(line)["step"] <= 8]  # fmt: skip
    (out / outputs.METRICS).write_text("\n".join(kept) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "wholeshard", *_train_args(text_file, out), "--nproc", "2"],
        env=_env(uuid.uuid4().hex),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "world size 1 -> 2 (the checkpoint of step 8 was saved by 1 rank(s)); the global "
        "batch and its order are unchanged: 4 sequences per step = 2 ranks x 2" in proc.stderr
    )
    [event] = _world_events(out)
    assert (event["from"], event["to"], event["resume_step"], event["first_step"]) == (1, 2, 8, 9)
    assert event["last_logged_step"] == 8 and event["since_last_step_s"] > 0
    _check_losses(out, reference)
