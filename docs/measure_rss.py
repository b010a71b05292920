"""Measure a `wholeshard train` run's resident memory per worker against the step it is at.

    python docs/measure_rss.py rss.csv -- --steps 2000 --out runs/rss [--overlap]

Runs `python -m wholeshard train <flags>` (the flags must include --out), samples every
worker's VmRSS from /proc once a second next to the last step in metrics.jsonl, writes the
samples to the CSV, and prints each worker's RSS at step 200 and at the last step before the
run's end (the final plot imports matplotlib, which is not the step's memory).
"""

import csv
import json
import os
import subprocess
import sys
import time

FROM_STEP = 200


def workers(launcher: int) -> list[int]:
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


def last_step(metrics: str) -> int:
    try:
        with open(metrics, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return json.loads(lines[-1])["step"]
    except (OSError, ValueError, IndexError, KeyError):
        return -1


def main() -> None:
    out_csv, flags = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
    metrics = os.path.join(flags[flags.index("--out") + 1], "metrics.jsonl")
    steps = int(flags[flags.index("--steps") + 1])
    run = subprocess.Popen([sys.executable, "-m", "wholeshard", "train", *flags])
    rows = []
    with open(out_csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["time_s", "step", "pid", "rss_kb"])
        start = time.time()
        while run.poll() is None:
            step = last_step(metrics)
            for pid in workers(run.pid):
                if (kb := rss_kb(pid)) is not None:
                    rows.append((time.time() - start, step, pid, kb))
                    w.writerow(rows[-1])
            time.sleep(1.0)
    for rank, pid in enumerate(sorted({r[2] for r in rows})):
        mine = [r for r in rows if r[2] == pid and FROM_STEP <= r[1] < steps]
        a, b = mine[0], mine[-1]
        print(
            f"worker {rank}: step {a[1]} {a[3] / 1024:.1f} MiB, step {b[1]} {b[3] / 1024:.1f} MiB,"
            f" growth {100 * (b[3] / a[3] - 1):+.2f}%; min/max in between "
            f"{min(r[3] for r in mine) / 1024:.1f}/{max(r[3] for r in mine) / 1024:.1f} MiB"
        )


if __name__ == "__main__":
    main()
