"""Measure what a checkpoint save costs the step that saves: background (the default) vs
`--checkpoint-blocking`, on the default job of `wholeshard train`.

    python tools/measure_checkpoint_stall.py [--every 50] [--runs-dir DIR] [--json OUT]

Runs `python -m wholeshard train --checkpoint-every N --out DIR --no-progress` once per mode
(the default job otherwise: tiny byte GPT, 2 processes, 300 steps) and prints, per mode, the
median `save_s` (how long the save held the step, from `metrics.jsonl`), the median `step_s` of
the steps that save and of those that do not, and the host memory each rank's staging takes: the
bytes of the tensors it writes, read back from the checkpoint (each rank's DCP file), which is
what `AsyncSave.staged_bytes` reports for it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from result_file import write_results

MODES = {"background": [], "blocking": ["--checkpoint-blocking"]}


def staged_bytes_per_rank(ckpt: Path) -> dict[int, int]:
    """Bytes of the tensors each rank wrote to `ckpt` (its `__R_0.distcp` file)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(ckpt).read_metadata()
    sizes = {
        (fqn, tuple(chunk.offsets)): math.prod(chunk.sizes) * md.properties.dtype.itemsize
        for fqn, md in metadata.state_dict_metadata.items()
        if hasattr(md, "chunks")
        for chunk in md.chunks
    }
    per_rank: dict[int, int] = defaultdict(int)
    for index, info in metadata.storage_data.items():
        rank = int(re.match(r"__(\d+)_", info.relative_path)[1])
        per_rank[rank] += sizes[(index.fqn, tuple(index.offset))]
    return dict(sorted(per_rank.items()))


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(mode: str, out: Path, every: int) -> dict:
    argv = ["train", "--checkpoint-every", str(every), "--out", str(out), "--no-progress"]
    cmd = [sys.executable, "-m", "wholeshard", *argv, *MODES[mode]]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_s" in r and r["step"] > 1]  # step 1: warm-up
    saving = [r for r in steps if "save_s" in r]
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    return {
        "mode": mode,
        "command": "wholeshard " + " ".join(argv[:3] + MODES[mode]),
        "saves": len(saving),
        "save_s": statistics.median(r["save_s"] for r in saving),
        "saving_step_s": statistics.median(r["step_s"] for r in saving),
        "other_step_s": statistics.median(r["step_s"] for r in steps if "save_s" not in r),
        "staged_bytes_per_rank": staged_bytes_per_rank(latest),
        "trainer_pt_bytes": (latest / "trainer.pt").stat().st_size,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--runs-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    runs = args.runs_dir or Path(tempfile.mkdtemp(prefix="checkpoint-stall-"))
    load_at_start = os.getloadavg()[0]
    rows = [measure(mode, runs / mode, args.every) for mode in MODES]
    print(f"{cpu_name()}, {os.cpu_count()} cores, python {platform.python_version()}, ", end="")
    print(f"load average {load_at_start:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| mode | saves | median save_s | median step_s, saving / other | staged per rank |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        staged = ", ".join(f"{b / 2**20:.2f} MiB" for b in r["staged_bytes_per_rank"].values())
        print(
            f"| `{r['command']}` | {r['saves']} | {r['save_s'] * 1e3:.0f} ms | "
            f"{r['saving_step_s'] * 1e3:.0f} / {r['other_step_s'] * 1e3:.0f} ms | {staged} |"
        )
    if args.json is not None:
        write_results(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
