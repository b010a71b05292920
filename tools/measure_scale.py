"""What wholeshard plans for the presets from 8 to 1024 ranks; writes docs/results/scale.json.

    python tools/measure_scale.py [--json docs/results/scale.json]

For every preset of issue 20 (and gpt2-small) at dp 8, 64, 256 and 1024, two settings, each
through `capacity.choice.plan_and_choice` (the plan `DataParallel` makes, with its report): the
defaults (strategy "auto", one shard group: k = dp) and `shard_group_size="auto"`. Each row: the
choice (k, strategy, whether every target of [Note: plan targets] holds), the figures the
targets are about (largest bucket and its limit, padding, Newton-Schulz imbalance in the
planner's cost), the buckets and their collectives, and what the plan costs the busiest rank
(`capacity.costs`): ZeRO-1/2 optimizer state in fp32, and fully sharded with bf16 params and
fp32 grads, overlapped, its persistent bytes and peak of full buckets alive at once. Plan
seconds depend on the machine; the rest is exact. `python tools/make_docs.py` renders
docs/planning.md's table from the file.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from result_file import per_preset, write_measured  # noqa: E402

from wholeshard.bench.report import machine  # noqa: E402
from wholeshard.capacity.choice import plan_and_choice  # noqa: E402
from wholeshard.capacity.costs import Mode, plan_costs  # noqa: E402
from wholeshard.capacity.presets import PRESETS  # noqa: E402

DPS = (8, 64, 256, 1024)
NAMES = ("gpt2-small", "llama3-8b", "llama3-70b", "qwen3-30b-a3b", "moe-256x")
FULLY = Mode(
    reshard_after_forward=True,
    param_dtype="bfloat16",
    overlap_grad_reduce=True,
    overlap_param_gather=True,
)


def row(name: str, specs: list, dp: int, groups: str | None) -> dict:
    start = time.perf_counter()
    plan, choice = plan_and_choice(specs, dp, shard_group_size=groups)
    seconds = time.perf_counter() - start
    assert choice is not None  # the automatic strategy always explains itself
    zero, fully = plan_costs(plan, specs), plan_costs(plan, specs, FULLY)
    buckets = [b for buffer in plan.buffers for b in buffer.buckets]
    return {
        "preset": name,
        "dp": dp,
        "shard_group_size": "auto" if groups else None,
        "k": plan.shard_group_size,
        "strategy": plan.strategy,
        "meets_targets": choice.meets_targets,
        "reason": choice.reason,
        "buckets": len(buckets),
        "owner_buckets": sum(b.owners for b in buckets),
        "largest_bucket": choice.largest_bucket,
        "bucket_limit": choice.bucket_limit,
        "padding_fraction": choice.padding_fraction,
        "ns_imbalance": choice.ns_imbalance,
        "zero_optimizer_state_bytes": zero.persistent[zero.worst_rank]["optimizer_state"],
        "fully_sharded_persistent_bytes": fully.persistent[fully.worst_rank]["total"],
        "fully_sharded_peak_transient_bytes": fully.peak_transient,
        "collectives_per_step": fully.counts(),
        "plan_seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=str(ROOT / "docs" / "results" / "scale.json"))
    args = parser.parse_args(argv)

    def rows_of(name: str) -> list[dict]:
        specs = PRESETS[name]()
        return [row(name, specs, dp, groups) for dp in DPS for groups in (None, "auto")]

    rows = per_preset("measure_scale", NAMES, rows_of)
    write_measured(
        args.json,
        machine(nproc=1),
        f"measure_scale: {len(rows)} plans written to",
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
