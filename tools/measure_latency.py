"""Price one step's collectives of four presets at dp 8-1024 beside FSDP2-style equal shards,
and write docs/results/latency.json.

    python tools/measure_latency.py [--json docs/results/latency.json] [--fabric F] [--gpu G]

For each preset and dp, the plan `wholeshard plan --preset P --dp N` makes (its defaults: the
automatic strategy, one shard group, bf16 params, grads reduced in fp32, ZeRO-1/2 with the grad
reduce overlapped, clipping) and what `wholeshard plan ... --fabric F --gpu G --json` projects
for it (`projection`: collectives, bytes sent per rank, latency and bandwidth seconds, the
busiest rank's Newton-Schulz seconds); beside it the same figures of FSDP2-style equal shards
of the same model (`wholeshard.capacity.equal_shards`) in the same mode. Nothing is timed but
the planning; the figures are exact for the code that computes them. `python
tools/make_docs.py` renders the table of docs/planning.md from the file.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from result_file import write_measured  # noqa: E402

from wholeshard.bench.report import machine  # noqa: E402
from wholeshard.capacity.alpha_beta import FABRICS  # noqa: E402
from wholeshard.capacity.choice import plan_and_choice  # noqa: E402
from wholeshard.capacity.costs import Mode, plan_costs  # noqa: E402
from wholeshard.capacity.equal_shards import equal_shard_collectives  # noqa: E402
from wholeshard.capacity.presets import PRESETS  # noqa: E402
from wholeshard.capacity.projection import GPUS, comm_price, project  # noqa: E402

PRESET_NAMES = ("llama3-8b", "qwen3-30b-a3b", "llama3-70b", "moe-256x")
DPS = (8, 64, 256, 1024)
MODE = Mode(param_dtype="bfloat16", grad_reduce_dtype="float32")
"""`wholeshard plan`'s defaults (the train job's dtypes)."""


def row(preset: str, specs: list, dp: int, fabric: str, gpu: str) -> dict:
    plan, _ = plan_and_choice(specs, dp)
    costs = plan_costs(plan, specs, MODE)
    p = project(costs, fabric, gpu)
    equal = equal_shard_collectives(specs, dp, MODE)
    fsdp = comm_price(equal, dp, dp, FABRICS[fabric])
    return {
        "preset": preset,
        "dp": dp,
        "strategy": plan.strategy,
        "shard_group_size": plan.shard_group_size,
        "collectives": costs.counts(),
        "projection": p.as_dict(),
        "equal_shards": {
            "collectives": len(equal),
            "bytes_sent": sum(c.bytes_sent for c in equal),
            "latency_s": fsdp.latency_s,
            "bandwidth_s": fsdp.bandwidth_s,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=str(ROOT / "docs" / "results" / "latency.json"))
    parser.add_argument("--fabric", choices=sorted(FABRICS), default="nvlink4-ndr400")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    args = parser.parse_args(argv)
    rows = []
    for preset in PRESET_NAMES:
        specs = PRESETS[preset]()
        start = time.perf_counter()
        rows += [row(preset, specs, dp, args.fabric, args.gpu) for dp in DPS]
        print(f"measure_latency: {preset} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    write_measured(
        args.json,
        machine(nproc=1),
        f"measure_latency: {len(rows)} rows written to",
        fabric=args.fabric,
        gpu=args.gpu,
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
