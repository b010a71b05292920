"""Measure a `wholeshard train` run's resident memory per worker against the step it is at.

    python tools/measure_rss.py [--steps 2000] [--csv rss.csv] [-- TRAIN FLAGS ...]

Runs `python -m wholeshard train --steps N --out runs/measure_rss/<name> --overwrite
--no-progress TRAIN FLAGS`, samples every worker's VmRSS from /proc once a second next to the
last step in metrics.jsonl, and records each worker's RSS at step `--from-step` and at the last
step before the run's end (the final plot imports matplotlib, which is not the step's memory),
with the least and most RSS in between. The run's record replaces any record of the same
command in docs/results/rss.json (`--json`); `python tools/make_docs.py` renders the table of
docs/operations.md from it. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from result_file import write_results

from wholeshard.bench.report import machine

ROOT = Path(__file__).resolve().parent.parent


def workers(launcher: int) -> list[int]:
    """The spawned worker processes under `launcher`."""
    pids = []
    for task in os.listdir(f"/proc/{launcher}/task"):
        try:
            children = open(f"/proc/{launcher}/task/{task}/children").read().split()
        except OSError:
            continue
        for pid in map(int, children):
            try:
                if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read():
                    pids.append(pid)
            except OSError:
                pass
    return sorted(pids)


def rss_kb(pid: int) -> int | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def last_step(metrics: Path) -> int:
    try:
        with open(metrics, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return json.loads(lines[-1])["step"]
    except (OSError, ValueError, IndexError, KeyError):
        return -1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--from-step", type=int, default=200)
    parser.add_argument("--csv", help="also write every sample (time_s, step, pid, rss_kb) here")
    parser.add_argument("--json", default=str(ROOT / "docs" / "results" / "rss.json"))
    args = parser.parse_args(ours)
    name = "-".join(f.lstrip("-") for f in flags) or "default"
    out = Path("runs") / "measure_rss" / name
    command = ["wholeshard", "train", "--steps", str(args.steps), *flags]
    run = subprocess.Popen(
        [sys.executable, "-m", *command, "--out", str(out), "--overwrite", "--no-progress"],
        cwd=ROOT,
    )
    metrics = ROOT / out / "metrics.jsonl"
    samples = []
    start = time.time()
    while run.poll() is None:
        step = last_step(metrics)
        for pid in workers(run.pid):
            if (kb := rss_kb(pid)) is not None:
                samples.append((round(time.time() - start, 1), step, pid, kb))
        time.sleep(1.0)
    if run.returncode != 0:
        sys.exit(f"measure_rss: the run failed (exit {run.returncode})")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["time_s", "step", "pid", "rss_kb"])
            w.writerows(samples)
    record = {
        "command": " ".join(command),
        "date": datetime.date.today().isoformat(),
        "machine": machine(nproc=2),
        "workers": [],
    }
    for rank, pid in enumerate(sorted({s[2] for s in samples})):
        mine = [s for s in samples if s[2] == pid and args.from_step <= s[1] < args.steps]
        if not mine:
            sys.exit(f"measure_rss: no sample of worker {rank} between the steps measured")
        a, b = mine[0], mine[-1]
        worker = {
            "rank": rank,
            "from_step": a[1],
            "to_step": b[1],
            "from_mib": a[3] / 1024,
            "to_mib": b[3] / 1024,
            "growth": b[3] / a[3] - 1,
            "min_mib": min(s[3] for s in mine) / 1024,
            "max_mib": max(s[3] for s in mine) / 1024,
        }
        record["workers"].append(worker)
        print(
            f"worker {rank}: step {a[1]} {worker['from_mib']:.1f} MiB, step {b[1]} "
            f"{worker['to_mib']:.1f} MiB, growth {100 * worker['growth']:+.2f}%; min/max in "
            f"between {worker['min_mib']:.1f}/{worker['max_mib']:.1f} MiB"
        )
    path = Path(args.json)
    doc = json.loads(path.read_text()) if path.exists() else {"runs": []}
    doc["runs"] = [r for r in doc["runs"] if r["command"] != record["command"]] + [record]
    write_results(path, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
