"""`wholeshard train --max-restarts`: a run whose workers are SIGKILLed from outside (at
random steps, and once in the middle of a checkpoint save) ends bitwise equal to an
uninterrupted run, with every step in `metrics.jsonl` exactly once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from support import PINNED_NEWTON_SCHULZ
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from wholeshard import cli
from wholeshard.checkpoint.directory import TMP_PREFIX, TRAINER

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.005


def test_max_restarts_needs_checkpoints(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--max-restarts", "2", "--out", str(tmp_path / "run")])
    assert e.value.code == 2
    assert "--max-restarts" in capsys.readouterr().err


@dataclass
class Killer:
    """Watches a local `wholeshard train` run and SIGKILLs one of its workers (chosen by `rng`)
    once per target: ("step", s) when rank 0 has logged step s - 1, so the kill lands in step
    s; ("save", c) while the checkpoint of step c is being written. A save kill that lands too
    late (the restart resumes from step c itself) is tried again at the next checkpoint."""

    launcher: subprocess.Popen
    out: Path
    targets: list[tuple[str, int]]
    every: int
    rng: random.Random
    kills: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, step, worker)
    save_kill_landed: bool = False

    def run(self) -> None:
        for kind, step in self.targets:
            while True:
                if not self._wait(kind, step):
                    return
                restarts = len(self._events())
                worker = self.rng.randrange(len(self._workers()))
                os.kill(self._workers()[worker], signal.SIGKILL)
                self.kills.append((kind, step, worker))
                while len(self._events()) == restarts:  # the launcher logs the restart
                    if self.launcher.poll() is not None:
                        return
                    time.sleep(POLL_S)
                if kind == "step" or self._events()[-1]["resume_step"] < step:
                    self.save_kill_landed |= kind == "save"
                    break
                step += self.every  # the save had completed: try the next one

    def _wait(self, kind: str, step: int) -> bool:
        """Until the moment to kill for (kind, step); False if the run ended first."""
        tmp = self.out / "checkpoints" / f"{TMP_PREFIX}step-{step}"
        while self.launcher.poll() is None:
            if kind == "save" and tmp.is_dir() and len(self._workers()) > 1:
                return True
            if kind == "step" and self._last_step() >= step - 1:
                return True
            time.sleep(POLL_S if kind == "save" else 0.05)
        return False

    def _records(self) -> list[dict]:
        try:
            lines = (self.out / "metrics.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except ValueError:  # a line being written
                pass
        return records

    def _events(self) -> list[dict]:
        return [r for r in self._records() if r.get("event") == "restart"]

    def _last_step(self) -> int:
        return max((r["step"] for r in self._records() if "step" in r), default=-1)

    def _workers(self) -> list[int]:
        """The launcher's worker processes (spawned children), in start order."""
        pids = []
        for task in os.listdir(f"/proc/{self.launcher.pid}/task"):
            try:
                children = Path(f"/proc/{self.launcher.pid}/task/{task}/children").read_text()
            except OSError:
                continue
            for pid in map(int, children.split()):
                try:
                    if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        pids.append(pid)
                except OSError:
                    pass
        return sorted(pids)


def _train(out: Path, argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "wholeshard", "train", "--out", str(out), *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _final_state(out: Path, step: int) -> dict:
    """Every tensor of checkpoint step-`step` (params, optimizer state) and its trainer blob."""
    ckpt = out / "checkpoints" / f"step-{step}"
    dcp_to_torch_save(ckpt, out / "full.pt")
    state = torch.load(out / "full.pt", weights_only=False)
    state["trainer"] = torch.load(ckpt / TRAINER, weights_only=False)
    return state


def _assert_bitwise_equal(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise_equal(x, y, f"{where}[{i}]")
    elif where.endswith(("wall_s", "time")):
        pass
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def soak(
    tmp_path: Path, steps: int, every: int, targets: list[tuple[str, int]], argv: list[str]
) -> Killer:
    """Run `steps` steps straight and again under `Killer(targets)` with restarts; check the
    restarted run matches bit for bit and logs each step once."""
    common = [*argv, "--steps", str(steps), "--checkpoint-every", str(every), "--no-progress"]
    common += ["--keep-last", "2"]
    straight = _train(tmp_path / "straight", common)
    restarted = _train(tmp_path / "restarted", [*common, "--max-restarts", str(len(targets) + 2)])
    killer = Killer(restarted, tmp_path / "restarted", targets, every, random.Random(0))
    watcher = threading.Thread(target=killer.run, daemon=True)
    watcher.start()
    for p in (straight, restarted):
        out, err = p.communicate(timeout=3600)
        assert p.returncode == 0, err
    watcher.join(timeout=10)
    assert [k[0] for k in killer.kills].count("step") == sum(t == "step" for t, _ in targets)
    assert killer.save_kill_landed == any(t == "save" for t, _ in targets)

    records = [json.loads(line) for line in (tmp_path / "restarted" / "metrics.jsonl").open()]
    events = [r for r in records if r.get("event") == "restart"]
    assert len(events) == len(killer.kills)
    assert all("was killed by SIGKILL" in e["reason"] for e in events), events
    assert "Restart 1/" in err
    logged = [r["step"] for r in records if "event" not in r]
    assert logged == list(range(steps + 1)), "each step exactly once, in order"

    _assert_bitwise_equal(
        _final_state(tmp_path / "straight", steps), _final_state(tmp_path / "restarted", steps)
    )
    return killer


SMALL = ["--model", "micro", "--seq-len", "32", "--batch-size", "4", "--eval-every", "10"]
SMALL += PINNED_NEWTON_SCHULZ
SMALL += ["--eval-batches", "1"]


# Slow: in the default suite, test_newton_schulz.py's loaded run has --max-restarts restart a
# killed worker, and test_elastic.py's lost node resumes from the latest checkpoint.
@pytest.mark.slow
def test_a_killed_worker_is_restarted_from_the_latest_checkpoint(
    tmp_path: Path, text_file: Path
) -> None:
    soak(tmp_path, 16, 4, [("step", 7)], ["--data", str(text_file), *SMALL])


@pytest.mark.slow
def test_restarts_stop_after_max_restarts(tmp_path: Path, text_file: Path) -> None:
    argv = ["--data", str(text_file), *SMALL, "--steps", "30", "--checkpoint-every", "4"]
    run = _train(tmp_path / "run", [*argv, "--no-progress", "--max-restarts", "1"])
    killer = Killer(run, tmp_path / "run", [("step", 6), ("step", 10)], 4, random.Random(0))
    killer.run()
    _, err = run.communicate(timeout=600)
    assert run.returncode == 1 and len(killer.kills) == 2
    assert [e["restart"] for e in killer._events()] == [1]
    assert "Restart 1/1" in err and "worker failed; all workers stopped" in err


@pytest.mark.slow
def test_soak_three_kills_one_during_a_save_end_bitwise_equal(tmp_path: Path) -> None:
    """400 steps of the default (tiny) model with --checkpoint-every 25 --max-restarts 5;
    SIGKILLs at three random steps, one of them during a checkpoint save."""
    rng = random.Random(13)
    every = 25
    first = rng.randrange(20, 120)
    save = every * rng.randrange(7, 11)
    last = rng.randrange(save + 60, 380)
    targets = [("step", first), ("save", save), ("step", last)]
    killer = soak(
        tmp_path, 400, every, targets, ["--batch-size", "8", "--seq-len", "64", "--eval-every",
                                        "100", "--eval-batches", "2"]
    )  # fmt: skip
    print("kills (kind, step, worker):", killer.kills)
