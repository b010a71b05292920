"""Ctrl-C at any moment of a `wholeshard` command exits 130 with one line on stderr, never a
traceback: during its imports (the first seconds), in every subcommand, with `python -m
wholeshard` and the `wholeshard` entry point, and while spawned workers import.

A Ctrl-C lands at a chosen import, not at a chosen time: a `sitecustomize` hook sends SIGINT to
the process group (as a terminal does; or to its own process alone) when the command's process
(or, with `in_worker`, the first worker) first imports the module named.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from wholeshard.cli.train import STOPPING

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 180

HOOK = """
import os, signal, sys

module = os.environ.get("WS_TEST_SIGINT_AT")
root = os.environ.setdefault("WS_TEST_ROOT_PID", str(os.getpid()))
in_worker = root != str(os.getpid())
if module and in_worker == (os.environ.get("WS_TEST_SIGINT_IN") == "worker"):

    class Hook:
        def find_spec(self, name, path=None, target=None):
            if name == module:
                sys.meta_path.remove(self)
                try:  # once: the first worker's
                    os.close(os.open("sigint-sent", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    return None
                if os.environ.get("WS_TEST_SIGINT_TO") == "self":
                    os.kill(os.getpid(), signal.SIGINT)
                else:
                    os.killpg(0, signal.SIGINT)
            return None

    sys.meta_path.insert(0, Hook())
"""

ENTRY_POINT = "import sys; from wholeshard.cli import main; sys.exit(main())"
"""What the `wholeshard` script that pip writes runs."""


def _interrupted(
    tmp_path: Path, how: str, argv: list[str], at: str, in_worker: bool = False, to: str = "group"
) -> tuple[int, str, str]:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(hook), str(ROOT)]),
        WS_TEST_SIGINT_AT=at,
        WS_TEST_SIGINT_IN="worker" if in_worker else "command",
        WS_TEST_SIGINT_TO=to,
    )
    start = ["-m", "wholeshard"] if how == "-m" else ["-c", ENTRY_POINT]
    proc = subprocess.Popen(
        [sys.executable, *start, *argv],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, like a terminal's foreground job
    )
    try:
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def _train(text_file: Path, *extra: str) -> list[str]:
    return [
        "train", "--model", "micro", "--data", str(text_file), "--out", "run", "--steps", "2",
        "--batch-size", "4", "--seq-len", "16", "--eval-batches", "1", "--no-progress", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "how, command, at, prog",
    [
        ("-m", "train", "torch", "wholeshard train"),
        # torch's extension imports numpy and swallows a KeyboardInterrupt raised in it: the run
        # went on as if no Ctrl-C had come
        ("-m", "train", "numpy", "wholeshard train"),
        ("entry point", "train", "torch", "wholeshard train"),
        ("-m", "plan", "wholeshard.capacity.costs", "wholeshard"),  # building the parser
        ("entry point", "bench", "torch", "wholeshard bench"),
        ("-m", "export", "torch", "wholeshard export"),
    ],
)
def test_ctrl_c_during_an_import_exits_130_with_one_line(
    tmp_path: Path, text_file: Path, how: str, command: str, at: str, prog: str
) -> None:
    if at == "numpy":
        pytest.importorskip("numpy")
    argv = {
        "train": _train(text_file, "--nproc", "1"),
        "plan": ["plan", "--preset", "llama3-8b", "--dp", "8"],
        "bench": ["bench", "--quick", "--nproc", "1", "--config", "ddp_torch_muon"],
        "export": ["export", "no-such-checkpoint", "out.safetensors"],
    }[command]
    rc, out, err = _interrupted(tmp_path, how, argv, at)
    assert (rc, out, err) == (130, "", f"{prog}: interrupted\n")
    assert not (tmp_path / "run").exists()


def test_ctrl_c_while_workers_import_stops_them_after_the_first_step(
    tmp_path: Path, text_file: Path
) -> None:
    """Spawned workers import torch for seconds before they ignore SIGINT themselves; a Ctrl-C
    then reaches the command alone, which asks them to stop: both do after step 1, the first
    step boundary, without a traceback."""
    argv = _train(text_file, "--nproc", "2")
    rc, out, err = _interrupted(tmp_path, "-m", argv, "torch", in_worker=True)
    assert (rc, out) == (130, ""), err
    assert err.startswith(STOPPING + "\n") and "Traceback" not in err, err
    assert "wholeshard train: stopped after step 1\n" in err, err
    assert err.endswith("wholeshard train: interrupted; all workers stopped.\n"), err
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow  # the same import window under a Ctrl-C stays fast (the test above)
def test_a_worker_importing_leaves_sigint_to_the_command(tmp_path: Path, text_file: Path) -> None:
    """A SIGINT that reaches a spawned worker while it imports (before it ignores SIGINT) does
    not end it in a traceback: whether workers stop is the command's decision. (With a Ctrl-C,
    which reaches the command too, a worker's traceback raced the command stopping it.)"""
    argv = _train(text_file, "--nproc", "2", "--json")
    rc, out, err = _interrupted(tmp_path, "-m", argv, "torch", in_worker=True, to="self")
    assert rc == 0 and "Traceback" not in err, err
    assert json.loads(out)["steps"] == 2
