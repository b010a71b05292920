"""Ctrl-C while `wholeshard train` writes a checkpoint in the background: the first lets the
save finish (`latest` names it), a second abandons it (the previous one stays `latest`; the
partial one is removed by the next save).

The save is held in flight, not raced: rank 0's background write stops after its first file
item until the test releases it (`train_faults.py`'s `hold`), and the Ctrl-C is a SIGINT to the
command's process group, as a terminal sends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from train_faults import micro_argv

from wholeshard.checkpoint.directory import TMP_PREFIX

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 180
HELD_STEP = 4  # the save held; step 2's is complete
WAITING = f"stopping once the checkpoint of step {HELD_STEP} is written"


class Job:
    """`wholeshard train` in its own process group, a background save of step `HELD_STEP` held
    in flight on rank 0; its stderr read as it comes."""

    def __init__(self, tmp_path: Path, text_file: Path) -> None:
        self.out, self.hold = tmp_path / "run", tmp_path / "hold"
        self.hold.mkdir()
        argv = micro_argv(text_file, self.out, 1000, 1000, "--checkpoint-every", "2")
        argv += ["--no-progress", "--nproc", "2"]
        env = dict(os.environ, PYTHONPATH=str(ROOT), WHOLESHARD_TEST_HOLD=str(self.hold))
        fault = f"0:{HELD_STEP}:hold:mid_save"
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "train" / "train_faults.py"), fault, *argv],
            env={k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
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

    def until(self, ready, what: str) -> None:
        while not ready():
            assert self.proc.poll() is None or ready(), f"ended before {what}: {self.err}"
            assert time.monotonic() < self.deadline, f"never {what}: {self.err}"
            time.sleep(0.02)

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def end(self) -> int:
        try:
            self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.reader.join(timeout=10)
        return self.proc.returncode

    @property
    def err(self) -> str:
        return "".join(self.lines)

    def checkpoints(self) -> tuple[str, list[str]]:
        root = self.out / "checkpoints"
        return (root / "latest").read_text().strip(), sorted(p.name for p in root.iterdir())


@pytest.fixture
def job(tmp_path: Path, text_file: Path):
    job = Job(tmp_path, text_file)
    try:
        job.until((job.hold / "held").exists, "held the save")
        yield job
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)


def test_the_first_ctrl_c_finishes_the_save_in_flight(job: Job) -> None:
    job.ctrl_c()
    job.until(lambda: WAITING in job.err, "waited for the save")
    (job.hold / "release").write_text("")
    assert job.end() == 130, job.err
    assert job.err.endswith("wholeshard train: interrupted; all workers stopped.\n"), job.err
    assert "Traceback" not in job.err
    latest, names = job.checkpoints()
    assert latest == f"step-{HELD_STEP}" and names == ["latest", "step-2", f"step-{HELD_STEP}"]


def test_a_second_ctrl_c_abandons_it(job: Job) -> None:
    job.ctrl_c()
    job.until(lambda: WAITING in job.err, "waited for the save")
    job.ctrl_c()
    assert job.end() == 130, job.err
    assert "Traceback" not in job.err
    latest, names = job.checkpoints()
    assert latest == "step-2" and names == [f"{TMP_PREFIX}step-{HELD_STEP}", "latest", "step-2"]
