"""A projection of the communication and optimizer parts of a step, for a named fabric and GPU,
from a plan's costs (`costs.Costs`) alone.

[Note: the step projection]
Three terms, each at data-sheet peaks, added up as if nothing overlapped:

- `comm_s`: every collective of the step (`Costs.collectives`) by the alpha-beta ring model,
  `steps * latency + bytes_sent / bandwidth`, where a ring takes n - 1 steps (2 (n - 1) for an
  all-reduce) and `bytes_sent` is `ring_bytes`. A group of consecutive ranks that fits in one
  node (shard groups of k <= GPUs per node) runs on the intra-node link, any other on the
  inter-node one (one NIC per GPU, rail-optimised): replica groups and the step check span
  nodes as soon as dp exceeds a node.
- `newton_schulz_s`: the busiest rank's Newton-Schulz products (`ns_flops`: 5 iterations of
  `4 m^2 n + 2 m^3` flops per owned (m, n) matrix, m <= n) at the GPU's dense bf16 peak.
- `elementwise_s`: the rest of the optimizer step is memory-bound: every byte of this rank's
  masters, master grads, optimizer state and owned params and grads read and written once, at
  the GPU's memory bandwidth.

Left out: forward and backward (they need the batch, sequence and model FLOPs, not a plan),
overlap of any term with another (the engine overlaps reductions with backward and gathers with
forward, so `step_s` over-counts where it does), peaks never reached (tensor cores reach a
fraction of peak on small matrices; links 70-90% of line rate), NCCL's algorithm choice (tree,
NVLS, in-network reductions), congestion and topology beyond one node level, and the host
(kernel launches, Python). The figures in `FABRICS` and `GPUS` are data-sheet peaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..planning.plan import Plan
from ..planning.specs import matrix_count, matrix_shape
from .costs import ELEMENT_BYTES, Collective, Costs, owned

NS_STEPS = 5
"""Newton-Schulz iterations per Muon update (torch.optim.Muon's default)."""


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s one GPU sends (one direction)
    latency: float  # s per ring step


@dataclass(frozen=True)
class Fabric:
    """GPUs per node, the link among a node's GPUs and the one between nodes."""

    gpus_per_node: int
    intra: Link
    inter: Link


FABRICS = {
    "nvlink4-ndr400": Fabric(8, Link(450e9, 3e-6), Link(50e9, 6e-6)),  # DGX H100 / H200
    "nvlink3-hdr200": Fabric(8, Link(300e9, 3e-6), Link(25e9, 6e-6)),  # DGX A100
    "nvlink4-roce200": Fabric(8, Link(450e9, 3e-6), Link(25e9, 10e-6)),
    "pcie4-eth100": Fabric(8, Link(32e9, 5e-6), Link(12.5e9, 20e-6)),
}
"""Fabrics by name: NVLink 4 moves 450 GB/s per GPU per direction, NVLink 3 300, PCIe 4 x16
32; NDR InfiniBand 400 Gb/s = 50 GB/s per GPU, HDR 200 Gb/s and 200 Gb/s RoCE 25, 100 Gb/s
Ethernet 12.5. Latencies per ring step are round figures of NCCL's small-message times."""

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


def collective_seconds(c: Collective, plan: Plan, fabric: Fabric) -> float:
    """`c` by the alpha-beta ring model on the link its group runs on ([Note: the step
    projection]): shard groups are consecutive ranks, replica groups stride over all dp."""
    if c.ranks == 1:
        return 0.0
    spans = plan.shard_group_size if c.group == "shard" else plan.dp_size
    link = fabric.intra if spans <= fabric.gpus_per_node else fabric.inter
    steps = (2 if c.op == "all_reduce" else 1) * (c.ranks - 1)
    return steps * link.latency + c.bytes_sent / link.bandwidth


@dataclass(frozen=True)
class Projection:
    """Seconds per step of each term of [Note: the step projection], and their sum."""

    fabric: str
    gpu: str
    comm_s: float
    newton_schulz_s: float
    elementwise_s: float

    @property
    def step_s(self) -> float:
        return self.comm_s + self.newton_schulz_s + self.elementwise_s

    def as_dict(self) -> dict[str, str | float]:
        """Names and seconds, `wholeshard plan --json`'s `projection`."""
        terms = ("comm_s", "newton_schulz_s", "elementwise_s", "step_s")
        return {"fabric": self.fabric, "gpu": self.gpu} | {t: getattr(self, t) for t in terms}

    def describe(self) -> str:
        """One line for `wholeshard plan`'s table: the sum first, then its terms."""
        return (
            f"{self.step_s:.3g} s per step beyond forward and backward (communication "
            f"{self.comm_s:.3g} s + Newton-Schulz {self.newton_schulz_s:.3g} s + element-wise "
            f"{self.elementwise_s:.3g} s), projected on {self.fabric} with {self.gpu}: each term "
            "at peak, nothing overlapped"
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
    comm = sum(collective_seconds(c, plan, FABRICS[fabric]) for c in costs.collectives)
    element = ELEMENT_BYTES[mode.param_dtype] + ELEMENT_BYTES[mode.grad_reduce_dtype]
    touched = [
        p["masters"] + p["master_grads"] + p["optimizer_state"] + (o.matrix + o.adamw) * element
        for p, o in zip(costs.persistent, owned(plan, mode.transposed), strict=True)
    ]
    return Projection(
        fabric,
        gpu,
        comm_s=comm,
        newton_schulz_s=max(rank_ns_flops(plan)) / flops,
        elementwise_s=2 * max(touched) / memory,
    )
