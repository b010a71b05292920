"""`wholeshard train` end to end in subprocesses: 2 local ranks, torchrun, crashes, Ctrl-C.

Every run gets a unique marker in its environment; spawned workers inherit it, so scanning
/proc for the marker after the run finds any orphaned process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from support import PINNED_NEWTON_SCHULZ
from test_restarts import _assert_bitwise_equal, _final_state

from wholeshard.train import outputs

ROOT = Path(__file__).resolve().parents[2]
MARKER = "WHOLESHARD_TRAIN_TEST_MARKER"
HANG_GUARD_S = 180  # generous: a hung run fails instead of blocking the suite

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")


def _args(text_file: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train", "--model", "micro", "--data", str(text_file), "--out", str(out), "--steps", "4",
        "--batch-size",
        "4", "--seq-len", "16", "--eval-every", "2", "--eval-batches", "1", "--lr", "1e-2",
        "--json", *PINNED_NEWTON_SCHULZ, *extra,
    ]  # fmt: skip


def _env(marker: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env[MARKER] = marker
    env.update(extra)
    return env


def _marked(marker: str) -> list[int]:
    """Live processes (other than this one) whose environment carries the marker."""
    tag = f"{MARKER}={marker}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if tag in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def _assert_no_orphans(marker: str) -> None:
    deadline = time.monotonic() + 20
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _marked(marker)
    for pid in left:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not left, f"orphaned processes: {left}"


def _run(cmd: list[str], **env: str) -> tuple[subprocess.CompletedProcess, str]:
    marker = uuid.uuid4().hex
    proc = subprocess.run(
        cmd, env=_env(marker, **env), capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    _assert_no_orphans(marker)
    return proc, marker


def _summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # --json: the summary is the only stdout line
    return json.loads(lines[0])


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / outputs.METRICS).read_text().splitlines()]


@pytest.fixture(scope="module")
def muon_run(text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("runs") / "muon"
    args = _args(text_file, out, "--nproc", "2", "--checkpoint-every", "2")
    proc, _ = _run([sys.executable, "-m", "wholeshard", *args])
    (out.parent / "muon.stderr").write_text(proc.stderr)  # the progress bar's run
    return out, _summary(proc)


def _check_run(out: Path, summary: dict, optimizer: str) -> None:
    for key in ("steps", "final_loss", "final_val_loss", "first_val_loss", "tokens", "wall_s"):
        assert isinstance(summary[key], (int, float)), key
    assert summary["world_size"] == 2 and summary["optimizer"] == optimizer
    assert summary["steps"] == 4 and summary["tokens"] == 4 * 4 * 16
    assert summary["final_val_loss"] < summary["first_val_loss"]
    assert json.loads((out / outputs.SUMMARY).read_text()) == summary
    assert (out / outputs.PLOT).stat().st_size > 0
    recs = _records(out)
    steps = [r for r in recs if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert {"step", "loss", "lr", "tokens_per_s", "step_s", "grad_norm"} <= set(r)
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 2, 4]


def test_two_local_ranks_muon(muon_run: tuple[Path, dict]) -> None:
    _check_run(*muon_run, "muon")
    stderr = (muon_run[0].parent / "muon.stderr").read_text()
    assert "train: 100%" in stderr  # the progress bar ran ...
    assert "leaked semaphore" not in stderr  # ... and its lock left nothing at exit


@pytest.mark.slow  # AdamW in the train job: test_train_resume.py trains it with checkpoints
def test_two_local_ranks_adamw(text_file: Path, tmp_path: Path) -> None:
    args = _args(text_file, tmp_path, "--nproc", "2", "--optimizer", "adamw")
    proc, _ = _run([sys.executable, "-m", "wholeshard", *args])
    _check_run(tmp_path, _summary(proc), "adamw")


@pytest.mark.slow  # torchrun stays in the default suite: test_elastic, test_train_interrupt
def test_torchrun_gives_the_same_losses(
    text_file: Path, tmp_path: Path, muon_run: tuple[Path, dict]
) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*torchrun, "--nproc-per-node", "2", "-m", "wholeshard", *_args(text_file, tmp_path)]
    proc, _ = _run(cmd)
    summary = _summary(proc)
    _check_run(tmp_path, summary, "muon")
    losses = [(r.get("loss"), r.get("val_loss")) for r in _records(tmp_path)]
    assert losses == [(r.get("loss"), r.get("val_loss")) for r in _records(muon_run[0])]


# Slow: test_elastic's lost node covers torchrun's restart with `--resume auto`, and
# test_train_resume's crash then resume that the resumed run is bitwise the uninterrupted one.
@pytest.mark.slow
def test_torchrun_max_restarts_with_resume_auto_continues_the_run(
    text_file: Path, tmp_path: Path, muon_run: tuple[Path, dict]
) -> None:
    """The README's recipe: a rank SIGKILLed after step 3 of its first attempt; torchrun's
    relaunch resumes from step-2 and ends bitwise equal to the uninterrupted local run."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node", "2", "--max-restarts", "1"]
    faulty = [str(ROOT / "tests" / "train" / "train_faults.py"), "1:3:kill"]
    # Blocking saves: the kill comes one step after the save of step 2, which a background
    # write may not have finished by then (the relaunch would then start at step 0).
    ckpt = ("--checkpoint-every", "2", "--checkpoint-blocking", "--resume", "auto")
    args = _args(text_file, tmp_path, *ckpt)
    proc, _ = _run([*torchrun, *faulty, *args], TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    summary = _summary(proc)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in proc.stderr  # (the warning's)
    assert f"--resume auto: no checkpoint in {tmp_path / 'checkpoints'}; starting at step 0\n" in (
        proc.stderr
    )
    assert f"--resume auto: resumed from {tmp_path / 'checkpoints' / 'step-2'} at step 2" in (
        proc.stderr
    )
    _check_run(tmp_path, summary, "muon")  # each step logged once
    straight_out, straight = muon_run
    for key in ("final_loss", "final_val_loss", "first_val_loss"):
        assert summary[key] == straight[key], key
    losses = [(r.get("loss"), r.get("val_loss")) for r in _records(tmp_path)]
    assert losses == [(r.get("loss"), r.get("val_loss")) for r in _records(straight_out)]
    _assert_bitwise_equal(_final_state(straight_out, 4), _final_state(tmp_path, 4))


@pytest.mark.parametrize("kind", ["raise", pytest.param("kill", marks=pytest.mark.slow)])
def test_crashed_worker_stops_the_run(text_file: Path, tmp_path: Path, kind: str) -> None:
    args = _args(text_file, tmp_path, "--nproc", "2", "--steps", "1000")
    cmd = [sys.executable, str(ROOT / "tests" / "train" / "train_faults.py"), f"1:2:{kind}", *args]
    proc, _ = _run(cmd)  # rank 0 blocks in a collective
    assert proc.returncode != 0
    assert "worker failed" in proc.stderr
    if kind == "raise":  # (a killed worker leaves no traceback; its peer's error may come first)
        assert "rank 1 failed" in proc.stderr and "Traceback" in proc.stderr
        assert "RuntimeError: injected fault on rank 1 at step 2" in proc.stderr
    assert not (tmp_path / outputs.SUMMARY).exists()


@pytest.mark.parametrize("how", ["ctrl-c", pytest.param("parent-killed", marks=pytest.mark.slow)])
def test_interrupt_stops_every_worker(text_file: Path, tmp_path: Path, how: str) -> None:
    marker = uuid.uuid4().hex
    args = _args(text_file, tmp_path, "--nproc", "2", "--steps", "100000")
    proc = subprocess.Popen(
        [sys.executable, "-m", "wholeshard", *args],
        env=_env(marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, like a terminal's foreground job
    )
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        metrics = tmp_path / outputs.METRICS
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        if how == "ctrl-c":  # a terminal's Ctrl-C signals the whole foreground process group
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.kill()
        _, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    if how == "ctrl-c":
        assert "interrupted" in err
    _assert_no_orphans(marker)
