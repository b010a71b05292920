"""A projection of the communication and optimizer parts of a step, for a named fabric and GPU,
from a plan's costs (`costs.Costs`) alone.

[Note: the step projection]
Three terms, each at data-sheet peaks, added up as if nothing overlapped:

- `comm_s`: every collective of the step (`Costs.collectives`) priced by [Note: alpha-beta
  prices] in `alpha_beta`: `latency_s` (hops times the per-hop alpha, by the algorithm NCCL
  runs the kind with) plus `bandwidth_s` (bytes sent over the group's beta). A group of
  consecutive ranks that fits in one node (shard groups of k <= GPUs per node) runs on the
  intra-node link; one that spans nodes at the node's ring bandwidth, every NIC its ranks on a
  node reach (rail-optimised, one NIC per GPU): a flat group of whole nodes all of them, a
  replica group with one rank per node one NIC. Replica groups and the step check span nodes as
  soon as dp exceeds a node. With two-level groups (`Plan.node_size` n), a "node" stage is n
  consecutive ranks and a "cross" stage k / n ranks n apart, n of them on each node at once
  sharing its NICs (`Span.sharing`). An exchange buffer's all-to-alls differ from rank to
  rank, and each ends when its last rank's messages do, so each is priced at its busiest
  rank: the most seconds (latency plus bandwidth) of any rank's record of it
  (`exchange_slots` in `costs`), not at `Costs.collectives`' rank (the one holding the most
  bytes).
- `newton_schulz_s`: the busiest rank's Newton-Schulz products (`ns_flops`: 5 iterations of
  `4 m^2 n + 2 m^3` flops per owned (m, n) matrix, m <= n) at the GPU's dense bf16 peak.
- `elementwise_s`: the rest of the optimizer step is memory-bound: every byte of this rank's
  masters, master grads, optimizer state and owned params and grads read and written once, at
  the GPU's memory bandwidth.

Left out: forward and backward (they need the batch, sequence and model FLOPs, not a plan),
overlap of any term with another (the engine overlaps reductions with backward and gathers with
forward, so `step_s` over-counts where it does), peaks never reached (tensor cores reach a
fraction of peak on small matrices; links 70-90% of line rate), NCCL's protocols and in-network
reductions, congestion and topology beyond one node level, and the host (kernel launches,
Python). `FABRICS` (in `alpha_beta`) says where each link figure comes from; `GPUS` are
data-sheet peaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..planning.plan import Plan
from ..planning.specs import matrix_count, matrix_shape
from ..planning.sync import ELEMENT_BYTES, Collective
from ._exchange import exchange_slots
from .alpha_beta import FABRICS, Fabric, Price, Span, all_to_all_price, price
from .costs import Costs, Mode, owned

NS_STEPS = 5
"""Newton-Schulz iterations per Muon update (torch.optim.Muon's default)."""


GPUS = {
    "h100": (989e12, 3.35e12),
    "h200": (989e12, 4.8e12),
    "a100": (312e12, 2.04e12),
    "b200": (2250e12, 8.0e12),
}
"""(dense bf16 flop/s, memory bytes/s) by GPU (SXM parts; NVIDIA's data sheets)."""


def ns_flops(shape: Sequence[int], steps: int = NS_STEPS) -> int:
    """Newton-Schulz product flops of one update of an (m, n) matrix or a stack of them: per
    matrix and iteration `X X^T` (2 m^2 n), `G G` (2 m^3) and `G X` (2 m^2 n), m <= n; 0 for a
    param of fewer than two dims (routed to Muon by a shapes file, it has no matrix)."""
    if len(shape) < 2:
        return 0
    m, n = sorted(matrix_shape(shape))
    return matrix_count(shape) * steps * (4 * m * m * n + 2 * m**3)


def rank_ns_flops(plan: Plan) -> list[int]:
    """Newton-Schulz flops per step of the Muon matrices each shard-group rank owns: the plan's
    `rank_costs` with `ns_flops` as the matrix cost."""
    return replace(plan, matrix_cost=lambda m, n: ns_flops((m, n))).rank_costs()


def collective_price(c: Collective, dp: int, k: int, fabric: Fabric, node: int = 1) -> Price:
    """`c` priced on `fabric` ([Note: alpha-beta prices]) where its group sits among `dp`
    ranks in shard groups of `k` (in two levels of `node` ranks a node; 1: one level): a shard
    group is k consecutive ranks, a replica group dp / k ranks k apart, "dp" every rank, a
    "node" stage `node` consecutive ranks, a "cross" stage k / node ranks `node` apart, as many
    on each node at once as its ranks fall into."""
    stride = {"replica": k, "cross": node}.get(c.group, 1)
    sharing = min(node, fabric.gpus_per_node) if c.group == "cross" else 1
    span = Span.of(c.ranks, stride, fabric.gpus_per_node, sharing)
    payload = c.numel * ELEMENT_BYTES[c.dtype]
    if c.op == "all_to_all":
        received = c.received * ELEMENT_BYTES[c.dtype]
        return all_to_all_price(span, payload, received, c.peers, fabric)
    return price(c.op, span, c.bytes_sent, payload, fabric)


def comm_price(
    collectives: Sequence[Collective], dp: int, k: int, fabric: Fabric, node: int = 1
) -> Price:
    """The latency and bandwidth terms of `collectives` (`collective_price`), added up
    (nothing overlapped)."""
    prices = [collective_price(c, dp, k, fabric, node) for c in collectives]
    return Price(sum(p.latency_s for p in prices), sum(p.bandwidth_s for p in prices))


def exchange_price(plan: Plan, mode: Mode, fabric: Fabric) -> Price:
    """The latency and bandwidth terms of a step's all-to-alls (`exchange_slots`), each at its
    busiest rank ([Note: the step projection]), added up."""
    dp, k = plan.dp_size, plan.shard_group_size
    busiest = [
        max((collective_price(c, dp, k, fabric) for c in slot), key=lambda p: p.seconds)
        for slot in exchange_slots(plan, mode)
    ]
    return Price(sum(p.latency_s for p in busiest), sum(p.bandwidth_s for p in busiest))


def step_comm_price(costs: Costs, fabric: Fabric) -> Price:
    """The communication terms of a step of `costs` on `fabric` ([Note: the step projection]):
    its collectives, the all-to-alls at their busiest rank."""
    plan = costs.plan
    rest = [c for c in costs.collectives if c.op != "all_to_all"]
    comm = comm_price(rest, plan.dp_size, plan.shard_group_size, fabric, plan.node_size)
    a2a = exchange_price(plan, costs.mode, fabric)
    return Price(comm.latency_s + a2a.latency_s, comm.bandwidth_s + a2a.bandwidth_s)


def collective_seconds(c: Collective, plan: Plan, fabric: Fabric) -> float:
    """`c`'s seconds on `fabric` among `plan`'s ranks (`collective_price`)."""
    dp, k, node = plan.dp_size, plan.shard_group_size, plan.node_size
    return collective_price(c, dp, k, fabric, node).seconds


@dataclass(frozen=True)
class Projection:
    """Seconds per step of each term of [Note: the step projection], and their sum; the
    communication's collectives and bytes sent per rank, and its latency and bandwidth terms."""

    fabric: str
    gpu: str
    latency_s: float
    bandwidth_s: float
    newton_schulz_s: float
    elementwise_s: float
    collectives: int
    bytes_sent: int

    @property
    def comm_s(self) -> float:
        return self.latency_s + self.bandwidth_s

    @property
    def step_s(self) -> float:
        return self.comm_s + self.newton_schulz_s + self.elementwise_s

    def as_dict(self) -> dict[str, str | float]:
        """Names and figures, `wholeshard plan --json`'s `projection`."""
        terms = ("comm_s", "latency_s", "bandwidth_s", "newton_schulz_s", "elementwise_s",
                 "step_s", "collectives", "bytes_sent")  # fmt: skip
        return {"fabric": self.fabric, "gpu": self.gpu} | {t: getattr(self, t) for t in terms}

    def describe(self) -> str:
        """One line for `wholeshard plan`'s table: the sum first, then its terms."""
        return (
            f"{self.step_s:.3g} s per step beyond forward and backward (communication "
            f"{self.comm_s:.3g} s: latency {self.latency_s:.3g} s + bandwidth "
            f"{self.bandwidth_s:.3g} s; Newton-Schulz {self.newton_schulz_s:.3g} s + "
            f"element-wise {self.elementwise_s:.3g} s on the busiest rank), projected on "
            f"{self.fabric} with {self.gpu}: each term at peak, nothing overlapped"
        )


def project(costs: Costs, fabric: str, gpu: str) -> Projection:
    """Project `costs` onto `fabric` (a key of `FABRICS`) and `gpu` (of `GPUS`); the busiest
    rank's Newton-Schulz and element-wise work. ValueError for an unknown name."""
    if fabric not in FABRICS:
        raise ValueError(f"unknown fabric {fabric!r}; one of {sorted(FABRICS)}")
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; one of {sorted(GPUS)}")
    flops, memory = GPUS[gpu]
    plan, mode = costs.plan, costs.mode
    comm = step_comm_price(costs, FABRICS[fabric])
    element = ELEMENT_BYTES[mode.param_dtype] + ELEMENT_BYTES[mode.grad_reduce_dtype]
    touched = [
        p["masters"] + p["master_grads"] + p["optimizer_state"] + (o.matrix + o.adamw) * element
        for p, o in zip(costs.persistent, owned(plan, mode.transposed), strict=True)
    ]
    return Projection(
        fabric,
        gpu,
        latency_s=comm.latency_s,
        bandwidth_s=comm.bandwidth_s,
        newton_schulz_s=max(rank_ns_flops(plan)) / flops,
        elementwise_s=2 * max(touched) / memory,
        collectives=len(costs.collectives),
        bytes_sent=costs.bytes_sent,
    )
