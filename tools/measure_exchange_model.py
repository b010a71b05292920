"""Price a step of four presets at dp 64-1024 under four designs and two bandwidth models, and
which layout a step costs least on each fabric; write docs/results/exchange-model.json.

    python tools/measure_exchange_model.py [--json docs/results/exchange-model.json] [--gpu G]

Designs, per preset and dp, ZeRO-1/2 with bf16 params and grads reduced in fp32 (`wholeshard
plan`'s defaults): the default plan before the exchange strategy (`owners_era_default`); the
exchange plan (`--strategy exchange`, its default bucket size); FSDP2-style equal shards
(`capacity.equal_shards`, no Muon traffic: a floor); and the dion-style form (equal shards plus
`equal_shards.megabatch_all_to_alls`, with the Newton-Schulz of a rank that gets one matrix of
every shape per megabatch). Each priced on nvlink4-ndr400 under model N (`FABRICS`: a ring across
nodes at every NIC of a node, NCCL's tuning model) and model P (the same fabric with one NIC a
node: `dataclasses.replace(fabric, nics=1)`), the all-to-alls at their busiest rank ([Note: the
step projection]). Then, on every fabric of `FABRICS`, the step figures of balanced, owners and
exchange ([Note: strategy figures]) and whether balanced meets the planner's targets at k = dp.
Nothing is timed; the figures are exact for the code that computes them. `python
tools/make_docs.py` renders docs/planning.md's tables from the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from result_file import per_preset, write_measured  # noqa: E402

from wholeshard.bench.report import machine  # noqa: E402
from wholeshard.capacity.alpha_beta import FABRICS, Fabric  # noqa: E402
from wholeshard.capacity.choice import plan_and_choice  # noqa: E402
from wholeshard.capacity.costs import Collective, Costs, Mode, plan_costs  # noqa: E402
from wholeshard.capacity.equal_shards import (  # noqa: E402
    equal_shard_collectives,
    matrix_shapes,
    megabatch_all_to_alls,
)
from wholeshard.capacity.presets import PRESETS  # noqa: E402
from wholeshard.capacity.projection import (  # noqa: E402
    GPUS,
    comm_price,
    ns_flops,
    rank_ns_flops,
    step_comm_price,
)
from wholeshard.capacity.strategy_choice import COMPARED, owners_era_default  # noqa: E402
from wholeshard.planning.auto import search  # noqa: E402

PRESET_NAMES = ("llama3-8b", "llama3-70b", "qwen3-30b-a3b", "moe-256x")
DPS = (64, 256, 1024)
FABRIC = "nvlink4-ndr400"
MODE = Mode(param_dtype="bfloat16", grad_reduce_dtype="float32")
"""`wholeshard plan`'s defaults (the train job's dtypes), ZeRO-1/2."""


def models(name: str) -> dict[str, Fabric]:
    """Model N (the fabric as `FABRICS` has it) and model P (one NIC a node)."""
    return {"N": FABRICS[name], "P": dataclasses.replace(FABRICS[name], nics=1)}


def planned(costs: Costs, ns: float) -> dict:
    """A plan's design row: its step's figures under both bandwidth models."""
    prices = {m: step_comm_price(costs, f) for m, f in models(FABRIC).items()}
    return {
        "collectives": len(costs.collectives),
        "bytes_sent": costs.bytes_sent,
        "latency_s": prices["N"].latency_s,
        "bandwidth_s": {m: p.bandwidth_s for m, p in prices.items()},
        "newton_schulz_s": ns,
    }


def unplanned(collectives: list[Collective], dp: int, ns: float | None) -> dict:
    """A design row of collectives alone (equal shards, dion-style)."""
    prices = {m: comm_price(collectives, dp, dp, f) for m, f in models(FABRIC).items()}
    return {
        "collectives": len(collectives),
        "bytes_sent": sum(c.bytes_sent for c in collectives),
        "latency_s": prices["N"].latency_s,
        "bandwidth_s": {m: p.bandwidth_s for m, p in prices.items()},
        "newton_schulz_s": ns,
    }


def one(name: str, dp: int, flops: float) -> tuple[dict, list[dict]]:
    specs = PRESETS[name]()
    plans = {"auto": owners_era_default(specs, dp)}
    plans |= {s: plan_and_choice(specs, dp, strategy=s)[0] for s in COMPARED}
    costs = {s: plan_costs(p, specs, MODE) for s, p in plans.items()}
    ns = {s: max(rank_ns_flops(p)) / flops for s, p in plans.items()}
    equal = equal_shard_collectives(specs, dp, MODE)
    dion_ns = sum(math.ceil(n / dp) * ns_flops(s) for s, n in matrix_shapes(specs).items())
    designs = {
        "auto": planned(costs["auto"], ns["auto"]),
        "exchange": planned(costs["exchange"], ns["exchange"]),
        "equal_shards": unplanned(equal, dp, None),
        "dion": unplanned(equal + megabatch_all_to_alls(specs, dp, MODE), dp, dion_ns / flops),
    }
    row = {"preset": name, "dp": dp, "auto_strategy": plans["auto"].strategy, "designs": designs}
    balanced_ok = search(specs, dp, dp, strategy="balanced").chosen.ok
    rule = plan_and_choice(specs, dp)[0].strategy  # what `auto` plans now
    choices = []
    for fabric in sorted(FABRICS):
        steps = {}
        for s in COMPARED:
            price = step_comm_price(costs[s], FABRICS[fabric])
            steps[s] = price.latency_s + price.bandwidth_s + ns[s]
        choices.append({
            "preset": name,
            "dp": dp,
            "fabric": fabric,
            "balanced_meets_targets": balanced_ok,
            "rule": rule,
            "winner": min(steps, key=steps.__getitem__),
            "step_s": steps,
        })  # fmt: skip
    return row, choices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=str(ROOT / "docs" / "results" / "exchange-model.json"))
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    args = parser.parse_args(argv)
    flops = GPUS[args.gpu][0]
    pairs = per_preset(
        "measure_exchange_model", PRESET_NAMES, lambda name: [one(name, dp, flops) for dp in DPS]
    )
    rows = [row for row, _ in pairs]
    choices = [c for _, chosen in pairs for c in chosen]
    write_measured(
        args.json,
        machine(nproc=1),
        f"measure_exchange_model: {len(rows)} rows written to",
        fabric=FABRIC,
        gpu=args.gpu,
        rows=rows,
        choices=choices,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
