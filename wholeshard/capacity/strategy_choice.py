"""Which of the three layouts a step costs least, for `wholeshard plan`: the plan's own strategy
beside balanced equal shards, owner buckets and the exchange, each planned with the same
settings and projected ([Note: strategy figures]).

[Note: strategy figures]
For the strategy a plan chose (`Plan.strategy`) and each of "balanced", "owners" and "exchange"
(`COMPARED`), the plan `capacity.choice.plan_and_choice` makes with the same shard-group size
and bucket size (None: each strategy's default), its costs in the same `Mode`, and four
figures on one fabric and GPU: the step's collectives, their latency and bandwidth terms
([Note: the step projection] in `projection`: the all-to-alls at their busiest rank) and the
busiest rank's Newton-Schulz seconds; `step_s` is their sum (the element-wise update, about the
same for every layout, is left out). The runner-up is the compared strategy other than the
chosen one with the least `step_s`. These are figures to read beside the choice: the planning
rule itself (`planning.auto`) is decided from the targets, not from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..planning.auto import search
from ..planning.plan import Plan
from ..planning.specs import ParamSpec
from .alpha_beta import FABRICS, Fabric
from .choice import plan_and_choice
from .costs import Costs, plan_costs
from .projection import GPUS, rank_ns_flops, step_comm_price

COMPARED = ("balanced", "owners", "exchange")
"""The layouts `wholeshard plan` compares its choice with."""


@dataclass(frozen=True)
class StrategyFigures:
    """One strategy's step figures ([Note: strategy figures])."""

    collectives: int
    latency_s: float
    bandwidth_s: float
    newton_schulz_s: float

    @property
    def step_s(self) -> float:
        return self.latency_s + self.bandwidth_s + self.newton_schulz_s

    def as_dict(self) -> dict[str, float]:
        names = ("collectives", "latency_s", "bandwidth_s", "newton_schulz_s", "step_s")
        return {n: getattr(self, n) for n in names}


def figures(costs: Costs, fabric: Fabric, gpu: str) -> StrategyFigures:
    """The step figures of `costs` (a plan's, in a mode) on `fabric` and `gpu`."""
    comm = step_comm_price(costs, fabric)
    ns = max(rank_ns_flops(costs.plan)) / GPUS[gpu][0]
    return StrategyFigures(len(costs.collectives), comm.latency_s, comm.bandwidth_s, ns)


@dataclass(frozen=True)
class StrategyChoice:
    """The chosen strategy, the runner-up among `COMPARED` and each one's figures (those that
    could be planned: `unplanned` says why the others were not), on `fabric` with `gpu`."""

    chosen: str
    runner_up: str | None
    figures: dict[str, StrategyFigures]
    fabric: str
    gpu: str
    unplanned: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        """`wholeshard plan --json`'s `strategy_choice`."""
        return {
            "chosen": self.chosen,
            "runner_up": self.runner_up,
            "fabric": self.fabric,
            "gpu": self.gpu,
            "figures": {s: f.as_dict() for s, f in self.figures.items()},
            "unplanned": self.unplanned,
        }

    def describe(self) -> str:
        """One line for `wholeshard plan`'s table: each strategy's step, chosen first."""

        def one(name: str) -> str:
            f = self.figures[name]
            return (
                f"{name} {f.step_s:.3g} s ({f.collectives:,} collectives: latency "
                f"{f.latency_s:.3g} s + bandwidth {f.bandwidth_s:.3g} s + Newton-Schulz "
                f"{f.newton_schulz_s:.3g} s)"
            )

        others = [s for s in self.figures if s not in (self.chosen, self.runner_up)]
        text = f"chosen {one(self.chosen)}"
        if self.runner_up is not None:
            text += f"; runner-up {one(self.runner_up)}"
        text += "".join(f"; {one(s)}" for s in others)
        text += "".join(f"; {s} not planned ({why})" for s, why in self.unplanned.items())
        return f"{text}; per step on {self.fabric} with {self.gpu}, nothing overlapped"


def strategy_choice(
    costs: Costs,
    specs: Sequence[ParamSpec],
    fabric: str,
    gpu: str,
    bucket_size: int | None = None,
) -> StrategyChoice:
    """[Note: strategy figures] of the plan of `costs` (planned from `specs` with
    `bucket_size`) in its mode on `fabric` (a key of `FABRICS`) and `gpu` (of `GPUS`)."""
    plan, mode, links = costs.plan, costs.mode, FABRICS[fabric]
    found = {plan.strategy: figures(costs, links, gpu)}
    unplanned = {}
    for name in COMPARED:
        if name in found:
            continue
        try:
            other, _ = plan_and_choice(
                specs,
                plan.dp_size,
                bucket_size=bucket_size,
                strategy=name,
                shard_group_size=plan.shard_group_size,
            )
        except ValueError as e:  # no plan of this strategy for these settings
            unplanned[name] = str(e).splitlines()[0]
            continue
        found[name] = figures(plan_costs(other, specs, mode), links, gpu)
    rest = [s for s in COMPARED if s in found and s != plan.strategy]
    runner_up = min(rest, key=lambda s: found[s].step_s, default=None)
    return StrategyChoice(plan.strategy, runner_up, found, fabric, gpu, unplanned)


def owners_era_default(specs: Sequence[ParamSpec], dp_size: int) -> Plan:
    """The plan `auto` made at one shard group before the exchange strategy: balanced equal
    shards where they meet the targets, else owner buckets, whichever overshoots less (balanced
    on a tie). The baseline `docs/planning.md` compares the exchange with."""
    balanced = search(specs, dp_size, dp_size, strategy="balanced").chosen
    if balanced.ok:
        return balanced.plan
    owners = search(specs, dp_size, dp_size, strategy="owners").chosen
    return owners.plan if owners.overshoot < balanced.overshoot else balanced.plan
