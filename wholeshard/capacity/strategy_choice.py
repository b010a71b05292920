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
rule itself (`planning.auto`) is decided from the targets, not from them. With two-level groups
(`node_size`), every compared strategy is planned in them where it can be (owner buckets
cannot: `unplanned` says so).

[Note: group structure figures]
Beside the strategies, the group structure: for the chosen plan and the exchange and balanced
ones, the same plan in one level and in two levels of the fabric's GPUs per node ([Note:
two-level groups] in `planning.plan`; and in the plan's own node size), where two levels apply
(a shard group larger than a node, whole nodes of it, equal-shard buckets), each with the four
figures above. The chosen structure is the chosen strategy's with the least `step_s` (the
plan's own on a tie), the runner-up its other structure with the least; where the chosen one
is not the plan's, `wholeshard plan` says the option that gives it (`node_size=8`,
`--node-size 8`). Same plan, same owners: the Newton-Schulz term is the same in every
structure, and so are the bytes each rank sends; the latency and bandwidth terms decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..planning.auto import search
from ..planning.plan import Plan, two_level
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


def describe_figures(f: StrategyFigures) -> str:
    """`f` in words: the step, then its collectives and terms."""
    return (
        f"{f.step_s:.3g} s ({f.collectives:,} collectives: latency {f.latency_s:.3g} s + "
        f"bandwidth {f.bandwidth_s:.3g} s + Newton-Schulz {f.newton_schulz_s:.3g} s)"
    )


def structure_words(node_size: int) -> str:
    """A group structure by its node size: "one level", "two levels of 8"."""
    return "one level" if node_size == 1 else f"two levels of {node_size}"


@dataclass(frozen=True)
class GroupStructure:
    """The group structure (node size: 1 one level, else two levels of that many ranks a node)
    projected fastest for the plan of `strategy`, the runner-up and the figures of every
    structure of each strategy compared ([Note: group structure figures]); `planned`: the
    plan's own; `not_two_level`: why two levels do not apply, by strategy. Invariant: `chosen`
    and `runner_up` are keys of `figures[strategy]`."""

    strategy: str
    planned: int
    chosen: int
    runner_up: int | None
    figures: dict[str, dict[int, StrategyFigures]]
    not_two_level: dict[str, str]

    @property
    def option(self) -> str | None:
        """What to pass for the chosen structure where the plan has another (None: as planned)."""
        if self.chosen == self.planned:
            return None
        if self.chosen == 1:
            return "leave node_size unset (no --node-size)"
        return f"node_size={self.chosen}, --node-size {self.chosen}"

    def as_dict(self) -> dict[str, Any]:
        """`wholeshard plan --json`'s `strategy_choice.group_structure` (node sizes as keys)."""
        return {
            "strategy": self.strategy,
            "planned": self.planned,
            "chosen": self.chosen,
            "runner_up": self.runner_up,
            "option": self.option,
            "figures": {
                s: {str(n): f.as_dict() for n, f in by_size.items()}
                for s, by_size in self.figures.items()
            },
            "not_two_level": self.not_two_level,
        }

    def describe(self) -> str:
        """The words of `wholeshard plan`'s group structure line: the chosen structure (and
        the option that gives it), the runner-up, the other strategies' structures."""
        mine = self.figures[self.strategy]
        text = f"{structure_words(self.chosen)} {describe_figures(mine[self.chosen])}"
        option = self.option
        if option is None:
            text += " (as planned)"
        else:
            text += f", projected faster: {'pass ' if self.chosen > 1 else ''}{option}"
        if self.runner_up is not None:
            second = structure_words(self.runner_up)
            text += f"; runner-up {second} {describe_figures(mine[self.runner_up])}"
        why_not = self.not_two_level.get(self.strategy)
        text += "" if why_not is None else f"; no two levels: {why_not}"
        for name, by_size in self.figures.items():
            if name != self.strategy and len(by_size) > 1:
                each = ", ".join(
                    f"{structure_words(n)} {f.step_s:.3g} s" for n, f in by_size.items()
                )
                text += f"; {name}: {each}"
        return text


@dataclass(frozen=True)
class StrategyChoice:
    """The chosen strategy, the runner-up among `COMPARED` and each one's figures (those that
    could be planned: `unplanned` says why the others were not), on `fabric` with `gpu`; the
    group structure beside it (`structure`)."""

    chosen: str
    runner_up: str | None
    figures: dict[str, StrategyFigures]
    fabric: str
    gpu: str
    unplanned: dict[str, str]
    structure: GroupStructure

    def as_dict(self) -> dict[str, Any]:
        """`wholeshard plan --json`'s `strategy_choice`."""
        return {
            "chosen": self.chosen,
            "runner_up": self.runner_up,
            "fabric": self.fabric,
            "gpu": self.gpu,
            "figures": {s: f.as_dict() for s, f in self.figures.items()},
            "unplanned": self.unplanned,
            "group_structure": self.structure.as_dict(),
        }

    def describe(self) -> str:
        """One line for `wholeshard plan`'s table: each strategy's step, chosen first."""

        def one(name: str) -> str:
            return f"{name} {describe_figures(self.figures[name])}"

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
    node_size: int | None = None,
) -> StrategyChoice:
    """[Note: strategy figures] and [Note: group structure figures] of the plan of `costs`
    (planned from `specs` with `bucket_size` and `node_size`) in its mode on `fabric` (a key of
    `FABRICS`) and `gpu` (of `GPUS`)."""
    plan, mode, links = costs.plan, costs.mode, FABRICS[fabric]
    planned = {plan.strategy: costs}
    unplanned = {}
    for name in COMPARED:
        if name in planned:
            continue
        try:
            other, _ = plan_and_choice(
                specs,
                plan.dp_size,
                bucket_size=bucket_size,
                strategy=name,
                shard_group_size=plan.shard_group_size,
                node_size=node_size,
            )
        except ValueError as e:  # no plan of this strategy for these settings
            unplanned[name] = str(e).splitlines()[0]
            continue
        planned[name] = plan_costs(other, specs, mode)
    found = {name: figures(c, links, gpu) for name, c in planned.items()}
    rest = [s for s in COMPARED if s in found and s != plan.strategy]
    runner_up = min(rest, key=lambda s: found[s].step_s, default=None)
    structure = group_structure(planned, found, specs, links, gpu, plan.strategy)
    return StrategyChoice(plan.strategy, runner_up, found, fabric, gpu, unplanned, structure)


def group_structure(
    planned: dict[str, Costs],
    found: dict[str, StrategyFigures],
    specs: Sequence[ParamSpec],
    fabric: Fabric,
    gpu: str,
    chosen: str,
) -> GroupStructure:
    """[Note: group structure figures] of the `chosen` strategy's plan and the exchange and
    balanced ones among `planned` (their costs; `found`: their figures as planned)."""
    structures: dict[str, dict[int, StrategyFigures]] = {}
    not_two_level = {}
    for name in dict.fromkeys((chosen, "exchange", "balanced")):
        if name not in planned:
            continue
        costs = planned[name]
        plan, by_size = costs.plan, {costs.plan.node_size: found[name]}
        for size in sorted({1, fabric.gpus_per_node}):
            try:
                other = two_level(plan, size if size > 1 else None)
            except ValueError as e:  # owner buckets, or nodes that do not divide k
                not_two_level[name] = str(e).split("; ")[0]
                continue
            if other.node_size not in by_size:
                by_size[other.node_size] = figures(
                    plan_costs(other, specs, costs.mode), fabric, gpu
                )
        if len(by_size) == 1 and plan.node_size == 1 and name not in not_two_level:
            not_two_level[name] = (
                f"a shard group of {plan.shard_group_size} fits in a node of "
                f"{fabric.gpus_per_node} GPUs"
            )
        structures[name] = dict(sorted(by_size.items()))
    mine, own = structures[chosen], planned[chosen].plan.node_size
    best = min(mine, key=lambda n: (mine[n].step_s, n != own))
    runner_up = min((n for n in mine if n != best), key=lambda n: mine[n].step_s, default=None)
    return GroupStructure(chosen, own, best, runner_up, structures, not_two_level)


def owners_era_default(specs: Sequence[ParamSpec], dp_size: int) -> Plan:
    """The plan `auto` made at one shard group before the exchange strategy: balanced equal
    shards where they meet the targets, else owner buckets, whichever overshoots less (balanced
    on a tie). The baseline `docs/planning.md` compares the exchange with."""
    balanced = search(specs, dp_size, dp_size, strategy="balanced").chosen
    if balanced.ok:
        return balanced.plan
    owners = search(specs, dp_size, dp_size, strategy="owners").chosen
    return owners.plan if owners.overshoot < balanced.overshoot else balanced.plan
