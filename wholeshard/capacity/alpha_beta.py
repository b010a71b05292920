"""Alpha-beta prices of collectives on a named fabric: what one collective costs in latency
(hops times a per-hop alpha) and in bandwidth (bytes over the link's beta), by the algorithm
NCCL runs it with. Takes a collective's kind, group shape and bytes: not a plan.

[Note: alpha-beta prices]
A collective over n ranks, `per_node` of them on each of `nodes` nodes (`Span`), costs
`latency_s + bandwidth_s`:

- all_reduce: the cheaper of NCCL's two algorithms: a ring, 2 (n - 1) hops sending
  2 (n - 1) / n S per rank, or the double binary tree, 2 ((per_node - 1) + ceil(log2 nodes))
  hops sending 2 S (NCCL models its tree at half the bus bandwidth);
- reduce_scatter, all_gather: a ring, n - 1 hops;
- reduce, broadcast: a chain from the root through every rank (NCCL runs them on its ring
  algorithm only), n - 1 hops;
- reduce_coalesced, broadcast_coalesced (an owner bucket's reduces, or broadcasts, one per
  owner, issued as one group: `distributed.collectives`): their chains run at once, so the
  group takes one chain's n - 1 hops, and its bytes are those of one chain over the bucket;
- all_to_all (an exchange buffer's, `planning.sync.exchange`): NCCL has no all-to-all algorithm:
  torch issues `all_to_all_single` as grouped point-to-point, one send and one receive per peer
  inside one group (`ncclGroupStart/End`). Priced pairwise (the MPICH pairwise exchange's (p-1)
  alpha, an upper bound: NCCL spreads a group's peers over its channels and runs several at
  once): one alpha per peer the rank moves anything to or from (`peers`; zero-size pairs are not
  sent). A record carries how many peers, not which, so min(peers, per_node - 1) of them are
  charged the intra-node alpha and the rest the network's: exact for a dense all-to-all (n - 1
  peers, per_node - 1 of them in the node), and for a sparse one the fewest network hops its
  count allows (a rank's peers are the owners of the matrices around its shard, dealt by cost
  anywhere): it undercharges such a one by at most (per_node - 1) x (network - intra-node
  alpha), 43 us on nvlink4-ndr400. Bandwidth: the larger of the bytes the rank sends and
  receives, at one NIC's beta when the group spans nodes (each message is point-to-point: it
  leaves through the NIC of its GPU, not over a ring of the node's NICs; the bytes to peers in
  the node, over NVLink, are charged at that rate too, an upper bound), else the intra-node
  link.

Of a ring's or chain's hops, nodes - 1 (twice that for an all-reduce's ring) cross nodes and
cost the inter-node alpha, the others the intra-node one, as NCCL's tuning model counts them
(`ncclTopoTuneModel`, src/graph/tuning.cc). The bandwidth term is the bytes one rank sends
(`costs.ring_bytes`; the tree's 2 S) over the group's beta (`Fabric.beta`):

- inside one node, the intra-node link;
- across nodes, the node's ring bandwidth: min(nics, per_node) NICs at the per-NIC beta, at
  most `ring_cap` and the intra-node link. NCCL runs a collective on several channels, each a
  ring (or tree) that leaves a node through its own NIC, and its tuning model sets the bus
  bandwidth to the channels times one channel's inter-node bandwidth, capped per GPU
  generation (`ncclTopoTuneModel` in NCCL's src/graph/tuning.cc: 370 GB/s on Hopper, 235 GB/s
  on Ampere; later releases leave the bound to the channels' speeds, at most 48 GB/s a NIC in
  src/graph/search.cc). So a flat ring over whole DGX H100 nodes leaves each node through all
  eight NICs (7/8 of each GPU's hops are NVLink): min(8 x 50, 370) = 370 GB/s, where NVIDIA
  quotes 46-48 GB/s per NDR NIC in practice. A group with one rank per node (a replica group
  whose ranks sit a node or more apart) has one GPU, so one NIC, per node: each GPU on its own
  rail, 50 GB/s. A fabric of `nics=1` prices every group that spans nodes at one NIC's beta.
- groups that run at once and share a node's NICs (`Span.sharing`): a two-level shard group's
  "cross" stage ([Note: two-level groups] in `planning.plan`) is k / n ranks n apart, one per
  node, and on each node n of them run at once, one per local rank: their n rings leave the
  node through its NICs together, so each gets min(nics, n) / n of them (min(nics, per_node x
  sharing) / sharing in general): on nvlink4-ndr400 (8 NICs, n = 8) one NIC's 50 GB/s each,
  on a one-NIC fabric 1/8 of it, 6.25 GB/s. The replica groups' prices do not yet count that
  sharing (dp / k of them run at once too): each is priced as if it ran alone.
Left out: NCCL's per-launch base latency (a few microseconds), its protocols (LL, LL128 and
Simple trade latency for bandwidth per message size), its per-channel caps on trees and LL128,
NVLink SHARP and in-network reductions, congestion, and more than one level of nodes (racks,
spine switches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALGORITHMS = {
    "all_reduce": "ring or tree",
    "reduce_scatter": "ring",
    "all_gather": "ring",
    "reduce": "chain",
    "broadcast": "chain",
    "reduce_coalesced": "chains at once",
    "broadcast_coalesced": "chains at once",
    "all_to_all": "point-to-point, one message per peer",
}
"""The collective kinds priced here, and the algorithm each is priced by."""


@dataclass(frozen=True)
class Link:
    bandwidth: float  # beta: bytes/s one GPU sends (one direction)
    latency: float  # alpha: seconds per hop


@dataclass(frozen=True)
class Fabric:
    """GPUs per node, the link among a node's GPUs, one NIC's link between nodes, the NICs a
    node has and NCCL's cap on a ring's bus bandwidth ([Note: alpha-beta prices])."""

    gpus_per_node: int
    intra: Link
    inter: Link
    nics: int
    ring_cap: float = math.inf

    def beta(self, span: Span) -> float:
        """Bytes/s one rank of `span` sends: the intra-node link in one node, else the node's
        ring bandwidth (min(nics, per_node x sharing) / sharing NICs, at most `ring_cap` and
        the intra-node link)."""
        if span.nodes == 1:
            return self.intra.bandwidth
        nics = min(self.nics, span.per_node * span.sharing) / span.sharing
        return min(nics * self.inter.bandwidth, self.ring_cap, self.intra.bandwidth)


NVLINK4, NVLINK3, PCIE4 = 450e9, 300e9, 32e9
NDR, HDR, ROCE200, ETH100 = 400e9 / 8, 200e9 / 8, 200e9 / 8, 100e9 / 8
NVLINK_HOP, PCI_HOP, NET_HOP = 3.4e-6, 5.7e-6, 9.6e-6
HOPPER_RING, AMPERE_RING = 370e9, 235e9

FABRICS = {
    "nvlink4-ndr400": Fabric(8, Link(NVLINK4, NVLINK_HOP), Link(NDR, NET_HOP), 8, HOPPER_RING),
    "nvlink3-hdr200": Fabric(8, Link(NVLINK3, NVLINK_HOP), Link(HDR, NET_HOP), 8, AMPERE_RING),
    "nvlink4-roce200": Fabric(8, Link(NVLINK4, NVLINK_HOP), Link(ROCE200, NET_HOP), 8, HOPPER_RING),
    "pcie4-eth100": Fabric(8, Link(PCIE4, PCI_HOP), Link(ETH100, NET_HOP), 8),
}
"""Fabrics by name, and where each figure comes from.

Betas, per GPU and direction: NVLink 4 450 GB/s (NVIDIA H100 data sheet: 900 GB/s both
directions), NVLink 3 300 GB/s (A100 data sheet: 600 GB/s), PCIe 4.0 x16 32 GB/s (PCI-SIG:
16 GT/s x 16 lanes, 128b/130b, 31.5 GB/s); per NIC, one NIC per GPU (eight a node): NDR
InfiniBand 400 Gb/s = 50 GB/s (ConnectX-7; DGX H100 has eight), HDR InfiniBand 200 Gb/s = 25
GB/s (ConnectX-6; DGX A100 has eight), 200 Gb/s RoCE 25 GB/s, 100 Gb/s Ethernet 12.5 GB/s (line
rates). Ring caps, NCCL's tuning model's cap on a ring's bus bandwidth by GPU generation
(src/graph/tuning.cc): Hopper 370 GB/s, Ampere 235 GB/s; none for the PCIe fabric, whose ring
the PCIe link caps. A node's ring bandwidth: nvlink4-ndr400 370 GB/s, nvlink3-hdr200 200 GB/s,
nvlink4-roce200 200 GB/s, pcie4-eth100 32 GB/s.
Alphas, per hop: NCCL's tuning model's ring latencies for its Simple protocol (`hwLat` in
src/graph/tuning.cc): NVLink 3.4 us, PCI 5.7 us, network 9.6 us (one figure for every
network: TCP sockets are slower in practice); its LL protocol, chosen for small messages,
takes 0.47, 1.0 and 2.7 us a hop, so the latency term is an upper bound for those."""


@dataclass(frozen=True)
class Span:
    """Where a group's ranks sit: `ranks` in all, `per_node` of them on each of `nodes`, and
    `sharing` groups of this shape on each node at once, sharing its NICs (1: alone)."""

    ranks: int
    per_node: int
    nodes: int
    sharing: int = 1

    @staticmethod
    def of(ranks: int, stride: int, gpus_per_node: int, sharing: int = 1) -> Span:
        """A group of `ranks` ranks `stride` apart (1: consecutive), nodes of `gpus_per_node`,
        `sharing` such groups on a node at once."""
        per_node = max(1, min(ranks, gpus_per_node // stride))
        return Span(ranks, per_node, math.ceil(ranks / per_node), sharing)


@dataclass(frozen=True)
class Price:
    latency_s: float
    bandwidth_s: float

    @property
    def seconds(self) -> float:
        return self.latency_s + self.bandwidth_s


def price(op: str, span: Span, sent: int, payload: int, fabric: Fabric) -> Price:
    """One `op` over `span` ([Note: alpha-beta prices]): `sent` bytes one rank sends by the
    ring (or chain) algorithm, `payload` the collective's tensor in bytes (an all-reduce's
    tree sends twice that). ValueError for a kind not in `ALGORITHMS`, and for an all-to-all
    (`all_to_all_price`)."""
    if op not in ALGORITHMS:
        raise ValueError(f"unknown collective {op!r}; one of {sorted(ALGORITHMS)}")
    if op == "all_to_all":
        raise ValueError(
            "an all_to_all is priced by its peers and both directions: use all_to_all_price"
        )
    n = span.ranks
    if n <= 1:
        return Price(0.0, 0.0)
    intra, inter = fabric.intra, fabric.inter
    beta = fabric.beta(span)
    crossings = span.nodes - 1
    laps = 2 if op == "all_reduce" else 1
    hops, crossings = laps * (n - 1), laps * crossings
    ring = Price((hops - crossings) * intra.latency + crossings * inter.latency, sent / beta)
    if op != "all_reduce":
        return ring
    depth = math.ceil(math.log2(span.nodes)) if span.nodes > 1 else 0
    tree_hops = 2 * ((span.per_node - 1) * intra.latency + depth * inter.latency)
    tree = Price(tree_hops, 2 * payload / beta)
    return min(ring, tree, key=lambda p: p.seconds)


def all_to_all_price(span: Span, sent: int, received: int, peers: int, fabric: Fabric) -> Price:
    """One rank's all-to-all over `span` ([Note: alpha-beta prices]): `sent` and `received`
    bytes, to and from `peers` other ranks."""
    if span.ranks <= 1 or peers == 0:
        return Price(0.0, 0.0)
    near = min(peers, span.per_node - 1)
    latency = near * fabric.intra.latency + (peers - near) * fabric.inter.latency
    beta = fabric.intra.bandwidth if span.nodes == 1 else fabric.inter.bandwidth
    return Price(latency, max(sent, received) / beta)
