"""Ctrl-C while `wholeshard train` writes a checkpoint in the background: the first lets the
save finish (every rank stops after the same step, then `latest` names the save), a second
abandons it (the previous checkpoint stays `latest`; the partial one is removed by the next
save).

The save is held in flight, not raced: rank 0's background write stops after its first file
item until the test releases it, and its training waits until the run is asked to stop
(`train_faults.py`'s `hold`), so the Ctrl-C lands with that save in flight and no later one
started. The Ctrl-C is a SIGINT to the command's process group, as a terminal sends it: with the
local launcher it reaches the command, under torchrun the agent, which forwards the first to
every worker and sends SIGTERM at the second. Every process carries a marker in its environment
(torchrun's workers run in their own sessions): all are killed in the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from test_train_e2e import _env, _marked
from train_faults import micro_argv

from wholeshard.checkpoint.directory import TMP_PREFIX
from wholeshard.cli.train import STOPPING

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 120
HELD_STEP = 4  # the save held; step 2's is complete
STOPPED = f"wholeshard train: stopped after step {HELD_STEP + 1}\n"  # (the next one asked)
FINISHING = f"wholeshard train: finishing the checkpoint of step {HELD_STEP}\n"
INTERRUPTED = "wholeshard train: interrupted"
FAULTS = ROOT / "tests" / "train" / "train_faults.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")


class Job:
    """`wholeshard train` at 2 ranks (local workers, or `torchrun`) in its own process group, its
    background save of step `HELD_STEP` held in flight on rank 0; its stderr read as it
    comes."""

    def __init__(self, tmp_path: Path, text_file: Path, launcher: str) -> None:
        self.out, self.hold, self.launcher = tmp_path / "run", tmp_path / "hold", launcher
        self.hold.mkdir()
        argv = micro_argv(text_file, self.out, 1000, 1000, "--checkpoint-every", "2")
        argv += ["--no-progress"]  # (`--nproc` defaults to 2; torchrun would take it as its own)
        self.marker = uuid.uuid4().hex
        env = _env(self.marker, WHOLESHARD_TEST_HOLD=str(self.hold))
        command = [sys.executable] if launcher == "local" else TORCHRUN
        self.proc = subprocess.Popen(
            [*command, str(FAULTS), f"0:{HELD_STEP}:hold:mid_save", *argv],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, like a terminal's foreground job
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.deadline = time.monotonic() + HANG_GUARD_S

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def until(self, ready: Callable[[], bool], what: str) -> None:
        while not ready():
            assert self.proc.poll() is None or ready(), f"ended before it {what}: {self.err}"
            assert time.monotonic() < self.deadline, f"never {what}: {self.err}"
            time.sleep(0.02)

    def says(self, text: str) -> Callable[[], bool]:
        return lambda: text in self.err

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def end(self) -> int:
        try:
            self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        finally:
            self.kill()
            self.reader.join(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        for pid in [self.proc.pid] * (self.proc.poll() is None) + _marked(self.marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    @property
    def err(self) -> str:
        return "".join(self.lines)

    def checkpoints(self) -> tuple[str, list[str]]:
        root = self.out / "checkpoints"
        return (root / "latest").read_text().strip(), sorted(p.name for p in root.iterdir())


@pytest.fixture(params=["local", "torchrun"])
def job(tmp_path: Path, text_file: Path, request: pytest.FixtureRequest):
    job = Job(tmp_path, text_file, request.param)
    try:
        job.until((job.hold / "holding").exists, "held the save")
        yield job
    finally:
        job.kill()


def test_the_first_ctrl_c_finishes_the_save_in_flight(job: Job) -> None:
    job.ctrl_c()
    job.until(job.says(FINISHING), "stopped to finish the save")
    assert STOPPED in job.err
    (job.hold / "release").write_text("")
    code = job.end()
    assert STOPPING in job.err and INTERRUPTED in job.err, job.err
    if job.launcher == "local":
        assert code == 130 and job.err.endswith(INTERRUPTED + "; all workers stopped.\n"), job.err
        assert "Traceback" not in job.err
    else:  # each worker exits 130; torchrun itself raises (SignalException) and exits 1
        assert code == 1 and "[rank" not in job.err, job.err
    latest, names = job.checkpoints()
    assert latest == f"step-{HELD_STEP}" and names == ["latest", "step-2", f"step-{HELD_STEP}"]


# Under torchrun, slow: the first Ctrl-C's test covers how torchrun passes it to the workers,
# and this one's local case how a second one abandons the save.
@pytest.mark.parametrize(
    "job", ["local", pytest.param("torchrun", marks=pytest.mark.slow)], indirect=True
)
def test_a_second_ctrl_c_abandons_it(job: Job) -> None:
    job.ctrl_c()
    job.until(job.says(FINISHING), "stopped to finish the save")
    assert STOPPED in job.err
    job.ctrl_c()
    code = job.end()
    if job.launcher == "local":
        assert code == 130 and job.err.endswith(INTERRUPTED + "; all workers stopped.\n"), job.err
        assert "Traceback" not in job.err
    else:  # torchrun stops its workers with SIGTERM
        assert code == 1 and "Sending process" in job.err and "closing signal SIGTERM" in job.err
    latest, names = job.checkpoints()
    assert latest == "step-2" and names == [f"{TMP_PREFIX}step-{HELD_STEP}", "latest", "step-2"]
