"""Price the default plan of four presets at dp 64-1024 in one level and in two levels of 8 (a
reduce-scatter within the node, then across nodes), under two bandwidth models; write
docs/results/two-level.json.

    python tools/measure_two_level.py [--json docs/results/two-level.json] [--gpu G]

Per preset and dp, ZeRO-1/2 with bf16 params and grads reduced in fp32 (`wholeshard plan`'s
defaults): the plan `plan_for` makes (what `DataParallel` makes with no option) and the plan it
makes with `node_size=8` ([Note: two-level groups] in `planning.plan`), each priced on
nvlink4-ndr400 under model N (the fabric as `FABRICS` has it: a flat ring across nodes leaves
through every NIC of a node) and model P (one NIC a node: `dataclasses.replace(fabric,
nics=1)`), the all-to-alls at their busiest rank ([Note: the step projection]); the step is
latency + bandwidth + the busiest rank's Newton-Schulz ([Note: strategy figures]). Nothing is
timed; the figures are exact for the code that computes them. `python tools/make_docs.py`
renders docs/planning.md's table from the file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from measure_exchange_model import DPS, FABRIC, MODE, PRESET_NAMES, models  # noqa: E402
from result_file import per_preset, write_measured  # noqa: E402

from wholeshard.bench.report import machine  # noqa: E402
from wholeshard.capacity.alpha_beta import FABRICS  # noqa: E402
from wholeshard.capacity.costs import plan_costs  # noqa: E402
from wholeshard.capacity.presets import PRESETS  # noqa: E402
from wholeshard.capacity.projection import GPUS, rank_ns_flops, step_comm_price  # noqa: E402
from wholeshard.planning import plan_for  # noqa: E402

NODE = FABRICS[FABRIC].gpus_per_node
"""The two levels' node size: the fabric's GPUs per node (8)."""


def one(name: str, dp: int, flops: float) -> dict:
    """A preset at `dp`: its default plan's strategy and, per node size (1: one level), the
    step's collectives, latency, bandwidth under both models and Newton-Schulz."""
    specs = PRESETS[name]()
    levels = {}
    for node in (1, NODE):
        plan = plan_for(specs, dp, node_size=None if node == 1 else node)
        costs = plan_costs(plan, specs, MODE)
        prices = {m: step_comm_price(costs, f) for m, f in models(FABRIC).items()}
        levels[str(node)] = {
            "strategy": plan.strategy,
            "node_size": plan.node_size,
            "collectives": len(costs.collectives),
            "bytes_sent": costs.bytes_sent,
            "latency_s": prices["N"].latency_s,
            "bandwidth_s": {m: p.bandwidth_s for m, p in prices.items()},
            "newton_schulz_s": max(rank_ns_flops(plan)) / flops,
        }
    return {"preset": name, "dp": dp, "levels": levels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=str(ROOT / "docs" / "results" / "two-level.json"))
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    args = parser.parse_args(argv)
    flops = GPUS[args.gpu][0]
    rows = per_preset(
        "measure_two_level", PRESET_NAMES, lambda name: [one(name, dp, flops) for dp in DPS]
    )
    write_measured(
        args.json,
        machine(nproc=1),
        f"measure_two_level: {len(rows)} rows written to",
        fabric=FABRIC,
        gpu=args.gpu,
        node_size=NODE,
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
