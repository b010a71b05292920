"""`wholeshard ... | head`: output cut short by its reader ends quietly, with no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_reader_that_closes_early_gets_no_traceback() -> None:
    """The handling is `wholeshard.cli.main`'s, so it holds for every subcommand."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "wholeshard", "plan", "--preset", "llama3-70b", "--dp", "8"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader is gone before the first write: every write fails (EPIPE)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err
    assert err == ""
