"""The README's CPU example runs as it stands: the python block after its marker, on 2 gloo
processes started with the environment torchrun gives them, on whatever CPU runs the suite."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- readme-example: cpu -->"
HANG_GUARD_S = 300  # generous: a hung run fails instead of blocking the suite


def readme_example() -> str:
    """The python block that follows `MARKER` in README.md."""
    text = (ROOT / "README.md").read_text()
    assert text.count(MARKER) == 1, f"README.md must hold {MARKER} once"
    match = re.search(re.escape(MARKER) + r"\n```python\n(.*?)^```$", text, re.S | re.M)
    assert match, f"no python block right after {MARKER} in README.md"
    return match.group(1)


ENDED = "README example: ran to its end"
TORCH_EXIT_ABORT = "terminate called without an active exception"
"""torch 2.13's gloo race at interpreter shutdown, after the script's last line (docs/operations.md
"A rank that aborts at exit"): the example did all it says; only the exit code is torch's."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_cpu_example_trains_on_two_gloo_processes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        readme_example() + f"\nimport sys\nprint({ENDED!r}, file=sys.stderr, flush=True)\n"
    )
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=HANG_GUARD_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        aborted_after_the_end = p.returncode == -6 and err.endswith(
            f"{ENDED}\n{TORCH_EXIT_ABORT}\n"
        )
        assert p.returncode == 0 or aborted_after_the_end, (
            f"rank {rank} exited {p.returncode}:\n{err[-3000:]}"
        )
    logged = re.findall(r"^step (\d+) loss (\S+)$", outputs[0][0], re.M)
    assert [int(step) for step, _ in logged] == [0, 49, 50, 99, 100, 149, 150, 199], outputs[0][0]
    first, last = float(logged[0][1]), float(logged[-1][1])
    assert last < first / 4, f"the example did not learn: loss {first} -> {last}"
    assert outputs[1][0] == "", "only rank 0 prints"
