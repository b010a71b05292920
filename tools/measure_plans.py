"""Measure `plan_exactly` on every preset and write docs/results/plans.json.

    python tools/measure_plans.py [--json docs/results/plans.json] [--presets NAME ...]

Plans every preset (`wholeshard.capacity.presets.PRESETS`) at dp 8, 64, 256 and 1024, with
every shard-group size k that divides dp and is at least min(dp, max(8, dp / 8)), with both
strategies, and with two bucket sizes: DataParallel's default (`default_bucket_size(numel, dp)`,
rule "default") and Megatron's 40M elements (rule "40M"). Each row holds what `wholeshard plan
--preset P --dp N --shard-group-size K --strategy S --bucket-size B --json` reports: padding
fraction, Newton-Schulz cost imbalance, the number of buckets (all, and those of the 2-D Muon
buffer) and the wall seconds of `plan_exactly` (the median of 3 runs; one run for presets that
take over a second). Plan times depend on the machine and its load; the rest is exact.
`python tools/make_docs.py` renders the tables of docs/planning.md from the file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from result_file import write_measured  # noqa: E402

from wholeshard.bench.report import machine  # noqa: E402
from wholeshard.capacity.presets import PRESETS  # noqa: E402
from wholeshard.planning import default_bucket_size, plan_exactly  # noqa: E402

DPS = (8, 64, 256, 1024)
STRATEGIES = ("size_match", "balanced")
MEGATRON_BUCKET = 40_000_000
SLOW_S = 1.0
"""A preset whose first plan takes longer than this is planned once per cell, not 3 times."""


def shard_group_sizes(dp: int) -> list[int]:
    return [k for k in range(min(dp, max(8, dp // 8)), dp + 1) if dp % k == 0]


def measure(preset: str, specs: list, dp: int, k: int, strategy: str, rule: str) -> dict:
    numel = sum(s.numel for s in specs)
    bucket = default_bucket_size(numel, dp) if rule == "default" else MEGATRON_BUCKET
    times: list[float] = []
    while True:
        start = time.perf_counter()
        plan = plan_exactly(specs, dp, bucket_size=bucket, strategy=strategy, shard_group_size=k)
        times.append(time.perf_counter() - start)
        if len(times) == 3 or times[0] > SLOW_S:
            break
    return {
        "preset": preset,
        "dp": dp,
        "shard_group_size": k,
        "strategy": strategy,
        "bucket_rule": rule,
        "bucket_size": bucket,
        "padding_fraction": plan.padding_fraction,
        "ns_cost_imbalance": plan.ns_cost_imbalance,
        "buckets": sum(len(b.buckets) for b in plan.buffers),
        "muon_buckets": sum(len(b.buckets) for b in plan.buffers if b.kind == "matrix"),
        "plan_seconds": statistics.median(times),
        "plan_runs": len(times),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=str(ROOT / "docs" / "results" / "plans.json"))
    parser.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=list(PRESETS))
    args = parser.parse_args(argv)
    info = machine(nproc=1)
    rows = []
    for preset in args.presets:
        specs = PRESETS[preset]()
        start = time.perf_counter()
        for dp in DPS:
            for k in shard_group_sizes(dp):
                for strategy in STRATEGIES:
                    for rule in ("default", "40M"):
                        rows.append(measure(preset, specs, dp, k, strategy, rule))
        print(f"measure_plans: {preset} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    info["load_average_end"] = os.getloadavg()[0]
    write_measured(
        args.json,
        info,
        f"measure_plans: {len(rows)} plans written to",
        presets=args.presets,
        dps=list(DPS),
        megatron_bucket_size=MEGATRON_BUCKET,
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
