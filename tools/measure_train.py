"""Measure `wholeshard train` runs; store what they printed and logged in docs/results/train.json.

    python tools/measure_train.py [--set optimizers|fp8|rules|modes ...] [--runs-dir DIR]

Each set is a list of runs of the same job (same model, data, seed and 2 processes) with different
flags. Every run is `python -m wholeshard train FLAGS --out DIR --overwrite --no-progress`; its
`summary.json`, the validation losses and per-step times of its `metrics.jsonl`, and the lines it
printed are stored. A set is replaced as a whole, with the date and machine of its measurement;
the other sets in the file stay. `python tools/make_docs.py` renders the tables from the file.

- `optimizers`: the default job (Muon), and `--optimizer adamw` (torch DDP + AdamW).
- `fp8`: the default job with `--fp8 mxfp8` and with `--fp8 tensorwise`.
- `rules`: the default job with each matrix rule (`--matrix-optimizer`) at its default learning
  rate, 3x below and 3x above it; Muon also with `--ns-algorithm gram`. (On a CPU without bf16
  GEMM units torch's standard bf16 iteration takes most of the step: 26 minutes a run there.)
- `newton_schulz`: the default job with each `--newton-schulz` implementation fixed.
- `make_train`: the default job, as `make train` runs it, kept per CPU kind (`cpu_kind`: the
  CPU and its bf16 matmul units), since its time depends on them: a run replaces only its own
  kind's record.
- `modes`: 100 steps in each DataParallel mode (sync, overlap, pipelined step, fully sharded;
  the seeds' baselines are `wholeshard bench`'s).

Each run also leaves `measure_train.json` (its flags and output) in its directory; `--reuse`
builds the records from runs already finished there instead of running them again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from result_file import write_results

from wholeshard.bench.report import machine
from wholeshard.capacity.cpu import SLOW_BF16

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "train.json"
FIGURE = ROOT / "docs" / "images" / "train_loss.png"
"""The `optimizers` set's loss curves, drawn from the runs' metrics.jsonl."""

MODES_FLAGS = ["--steps", "100", "--eval-every", "100"]
SETS: dict[str, list[tuple[str, list[str]]]] = {
    "optimizers": [("muon", []), ("adamw", ["--optimizer", "adamw"])],
    "fp8": [
        ("fp8_mxfp8", ["--fp8", "mxfp8"]),
        ("fp8_tensorwise", ["--fp8", "tensorwise"]),
    ],
    "rules": [  # each rule at its default lr (`train.sections.DEFAULT_LR`), 3x below, 3x above
        ("rule_muon", []),
        ("rule_muon_lr3e-3", ["--lr", "0.003"]),
        ("rule_muon_lr3e-2", ["--lr", "0.03"]),
        ("rule_muon_gram", ["--ns-algorithm", "gram"]),
        ("rule_normuon", ["--matrix-optimizer", "normuon"]),
        ("rule_normuon_lr1e-2", ["--matrix-optimizer", "normuon", "--lr", "0.01"]),
        ("rule_normuon_lr1e-1", ["--matrix-optimizer", "normuon", "--lr", "0.1"]),
        ("rule_soap", ["--matrix-optimizer", "soap"]),
        ("rule_soap_lr1e-3", ["--matrix-optimizer", "soap", "--lr", "0.001"]),
        ("rule_soap_lr1e-2", ["--matrix-optimizer", "soap", "--lr", "0.01"]),
    ],
    "modes": [
        ("sync", [*MODES_FLAGS, "--no-overlap-grad-reduce"]),
        ("overlap", [*MODES_FLAGS, "--overlap"]),
        ("pipelined", [*MODES_FLAGS, "--overlap", "--pipelined-step"]),
        ("fully_sharded", [*MODES_FLAGS, "--reshard-after-forward"]),
        ("fully_sharded_overlap", [*MODES_FLAGS, "--overlap", "--reshard-after-forward"]),
    ],
}
SETS["newton_schulz"] = [
    (f"ns_{name}", ["--newton-schulz", name])
    for name in ("torch_bf16", "batched_bf16", "batched_fp32")
]
SETS["make_train"] = [("make_train", [])]
PER_CPU_KIND = {"make_train"}
"""Sets stored per CPU kind (`doc["per_cpu_kind"][set][kind]`) rather than one for all."""
SKIP_STEPS = 5
"""Per-step medians leave out this many first steps (warm-up)."""


OUTPUT = "measure_train.json"
"""Written into each run's directory: its flags and what it printed, for `--reuse`."""


def run_one(name: str, flags: list[str], runs_dir: Path, reuse: bool = False) -> dict:
    """Run the job once (or, with `reuse`, take the finished run already in its directory);
    return its record."""
    out = ROOT / runs_dir / name  # the job runs in ROOT, and is told `runs_dir / name`
    command = [
        "wholeshard", "train", *flags, "--out", str(runs_dir / name), "--overwrite", "--no-progress"
    ]  # fmt: skip
    start = time.time()
    if reuse and (out / "summary.json").exists():
        print(f"measure_train: reusing {out}", file=sys.stderr, flush=True)
        sidecar = out / OUTPUT
        saved = json.loads(sidecar.read_text()) if sidecar.exists() else {"flags": flags}
        if saved["flags"] != flags:
            sys.exit(f"measure_train: {out} was run with {saved['flags']}, not {flags}")
        output = saved.get("output")  # None: the run's output was not kept
        seconds = saved.get("seconds")
    else:
        print(f"measure_train: {' '.join(command)}", file=sys.stderr, flush=True)
        done = subprocess.run(
            [sys.executable, "-m", *command], capture_output=True, text=True, cwd=ROOT
        )
        if done.returncode != 0:
            sys.exit(f"measure_train: {name} failed (exit {done.returncode}):\n{done.stderr}")
        output, seconds = done.stderr + done.stdout, time.time() - start
        saved = {"flags": flags, "output": output, "seconds": seconds}
        (out / OUTPUT).write_text(json.dumps(saved) + "\n")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and r.get("step", 0) > SKIP_STEPS]
    waits = [r["comm_wait_s"] for r in steps if r.get("comm_wait_s") is not None]
    printed = [
        line
        for line in (output or "").splitlines()
        if line.startswith(("wholeshard train:", "routing:", f"{summary['steps']} steps"))
    ]
    return {
        "name": name,
        "command": " ".join(["wholeshard", "train", *flags]),
        "flags": flags,
        "summary": summary,
        "val_loss": {str(r["step"]): r["val_loss"] for r in records if "val_loss" in r},
        "train_loss": {str(r["step"]): r["loss"] for r in records if "loss" in r},
        "median_step_s": statistics.median(r["step_s"] for r in steps) if steps else None,
        "median_comm_wait_s": statistics.median(waits) if waits else None,
        "printed": printed,
        "seconds": seconds,
    }


def cpu_kind(info: dict) -> str:
    """The CPU of `machine()`'s `info` and the bf16 matmul units it has
    (`wholeshard.capacity.cpu.cpu_bf16_matmul`), which decide how fast Muon's bf16 products run
    (and which one `wholeshard train --newton-schulz auto` runs; this names the machine)."""
    import torch

    units = info["cpu_bf16_matmul"]
    if units == SLOW_BF16:
        units = f"{torch.backends.cpu.get_cpu_capability()}, no bf16 matmul units"
    return f"{info['cpu']} ({units})"


def draw(runs: list[dict], path: Path) -> None:
    """Training and validation loss of each run against the step, one colour per run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        colour = f"C{i}"
        train = sorted((int(k), v) for k, v in run["train_loss"].items())
        val = sorted((int(k), v) for k, v in run["val_loss"].items())
        ax.plot(*zip(*train, strict=True), lw=0.8, alpha=0.35, color=colour)
        ax.plot(*zip(*val, strict=True), "o-", ms=3, color=colour, label=run["command"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(title="validation (points), training (faint)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", choices=sorted(SETS), dest="sets")
    parser.add_argument("--runs-dir", default="runs/measure_train")
    parser.add_argument("--json", default=str(RESULTS), help="the results file to update")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="take runs already finished in --runs-dir instead of running them again",
    )
    args = parser.parse_args(argv)
    path = Path(args.json)
    doc = json.loads(path.read_text()) if path.exists() else {"sets": {}}
    for name in args.sets or ["optimizers"]:
        load_start = os.getloadavg()[0]
        runs = [run_one(run, flags, Path(args.runs_dir), args.reuse) for run, flags in SETS[name]]
        finished = max(
            (ROOT / args.runs_dir / run / "summary.json").stat().st_mtime for run, _ in SETS[name]
        )
        info = machine(nproc=2)
        record = {
            "date": datetime.date.fromtimestamp(finished).isoformat(),
            "machine": {
                **info,
                "cpu_kind": cpu_kind(info),
                # the load while these runs ran, where this invocation ran them
                "load_average_start": None if args.reuse else load_start,
                "load_average_end": None if args.reuse else os.getloadavg()[0],
            },
            "runs": runs,
        }
        if name in PER_CPU_KIND:
            doc.setdefault("per_cpu_kind", {}).setdefault(name, {})[cpu_kind(info)] = record
        else:
            doc["sets"][name] = record
        write_results(path, doc, f"measure_train: wrote set {name} to")
        if name == "optimizers" and path.resolve() == RESULTS:
            draw(runs, FIGURE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
