"""How a bucket synchronizes: each sync scheme's collectives, as torch-free records.

[Note: sync schemes]
A sync scheme says which collectives bring a bucket's gradients, summed, to their owners
(`reduce`) and the owners' params back to every rank (`gather`), in the order they are issued,
over the k ranks of a shard group. It is the one description of a bucket's collectives: the
engine executes it (`engine._sync` holds each scheme's executable half, by name), and
`capacity` (costs, latency prices) and `wholeshard plan` read it. A bucket names its scheme
(`Bucket.sync`); the schemes:

- "equal_shards": k equal shards of `shard_numel`: one reduce-scatter of the bucket, one
  all-gather of it.
- "owners": an owner bucket ([Note: owner buckets] in `specs`; `owner_starts` is its data): a
  coalesced group of one reduce per listed owner's shard, and one of a broadcast per shard
  ([Note: owner collectives] in `distributed.collectives`).
- "exchange": an exchange bucket ([Note: exchange buffers] in `_exchange`): one reduce-scatter
  and one all-gather, as equal shards; the step adds, per batch of exchange buckets in reduce
  order (`exchange_batches`), one all-to-all of the reduced matrix pieces to their owners after
  the batch's reductions, in the grad dtype, and one back, in the param dtype, before its
  gathers (`exchange`: each rank's sizes and peers).

Those are the core's (`SYNC_SCHEMES`); a layout registers more ([Note: layouts] in `layouts`),
each with its executable half, and names them in its buckets (`Bucket.scheme`).

With two-level groups ([Note: two-level groups] in `plan`), each reduce-scatter of a bucket over
the shard group is two, within the node ("node": n ranks, the whole bucket) then across nodes
("cross": k / n ranks, 1/n of it), and each all-gather the same two the other way (`two_level`).

A storage unit reduces its buckets in buffer order, each by its scheme, and with replicas (dp /
k shard groups) then all-reduces each non-empty reduced shard of its rank across them, in the
same order, once every bucket's first stage has landed (`unit_reduce`); it gathers its buckets
in buffer order (`unit_gather`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._exchange import Segment
from .specs import Bucket

ELEMENT_BYTES = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int32": 4,
}
"""Bytes per element of the dtypes a mode or a collective may name."""
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
            "half": "float16", "fp64": "float64", "double": "float64"}  # fmt: skip
OPS = ("reduce_scatter", "all_reduce", "all_gather", "broadcast", "reduce", "reduce_coalesced",
       "broadcast_coalesced", "all_to_all")  # fmt: skip
"""The collective kinds: torch's, an owner bucket's coalesced groups of reduces and of
broadcasts (one per owner's shard, [Note: owner collectives] in `distributed.collectives`), and
the exchange's all-to-all with split sizes (`all_to_all_single`)."""


def dtype_name(dtype: Any) -> str:
    """The name in `ELEMENT_BYTES` of `dtype`: a name (`"bfloat16"`, `"bf16"`) or a torch dtype
    (read from its name, so torch is never imported). ValueError for anything else."""
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in ELEMENT_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(ELEMENT_BYTES)}")
    return name


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues: `op` (one of `OPS`) over a group of `ranks`, moving
    `numel` elements of `dtype` (the full input of a reduce-scatter, the full output of an
    all-gather, the tensor of an all-reduce, a reduce or a broadcast; a coalesced group's parts
    together; what this rank sends in an all-to-all); `what` it is for; `group`: "shard" (k
    consecutive ranks), "replica" (dp / k ranks, k apart) or "dp" (every rank). An all-to-all
    also says what this rank `received` (elements) and from or to how many `peers` it moves
    anything (zero-size pairs are not sent). With two-level groups, "node" (the n ranks of a
    node) and "cross" (k / n ranks, one a node) stand for "shard" in its reduce-scatters and
    all-gathers."""

    op: str
    ranks: int
    numel: int
    dtype: str
    what: str
    group: str
    received: int = 0
    peers: int = 0

    @property
    def bytes_sent(self) -> int:
        return ring_bytes(self.op, self.numel * ELEMENT_BYTES[self.dtype], self.ranks)


def ring_bytes(op: str, nbytes: int, ranks: int) -> int:
    """Bytes one rank sends for `op` on a payload of `nbytes` over `ranks` ranks, by a
    bandwidth-optimal ring: all-reduce 2 (n-1)/n S; reduce-scatter, all-gather, and a
    pipelined reduce or broadcast (n - 1 of the n ranks send S) (n-1)/n S; a coalesced group of
    reduces or broadcasts, of S in all, as one of S; an all-to-all, S (what it sends)."""
    ring = (ranks - 1) / ranks
    if op == "all_to_all":
        return nbytes
    if op == "all_reduce":
        return round(2 * ring * nbytes)
    if op in OPS:  # every other op
        return round(ring * nbytes)
    raise ValueError(f"unknown collective {op!r}; one of {OPS}")


Describe = Callable[[Bucket, int, str], list[Collective]]
"""(bucket, shard group size k, dtype name) -> the collectives, in order."""


@dataclass(frozen=True)
class SyncScheme:
    """One way a bucket synchronizes ([Note: sync schemes]): `reduce` and `gather` describe
    the collectives it issues on the shard group; `words` says them in `wholeshard plan`'s
    bucket table."""

    name: str
    reduce: Describe
    gather: Describe
    words: str


def _one(op: str, what: str) -> Describe:
    """A scheme half of one `op` over the whole bucket (coalesced groups count as one)."""
    return lambda b, k, dtype: [Collective(op, k, b.numel, dtype, what, "shard")]


EQUAL_SHARDS = SyncScheme(
    "equal_shards",
    _one("reduce_scatter", "grads"),
    _one("all_gather", "params"),
    "reduce_scatter/all_gather",
)
OWNERS = SyncScheme(
    "owners",
    _one("reduce_coalesced", "grads"),
    _one("broadcast_coalesced", "params"),
    "reduce/broadcast",
)
EXCHANGE = SyncScheme(
    "exchange",
    _one("reduce_scatter", "grads"),
    _one("all_gather", "params"),
    "reduce_scatter/all_gather, exchanged",
)
CORE_SCHEMES = (EQUAL_SHARDS, OWNERS, EXCHANGE)
"""The core's sync schemes, which the planners' buckets name."""
SYNC_SCHEMES = {s.name: s for s in CORE_SCHEMES}
"""Every sync scheme by name: the core's and those layouts registered (`register_scheme`)."""


def register_scheme(scheme: SyncScheme) -> None:
    """Add `scheme` to `SYNC_SCHEMES` (a layout's, [Note: layouts] in `layouts`); registering
    the same one again is a no-op, another under a taken name a ValueError."""
    if SYNC_SCHEMES.setdefault(scheme.name, scheme) != scheme:
        raise ValueError(f"a different sync scheme is registered as {scheme.name!r}")


def scheme_of(bucket: Bucket) -> SyncScheme:
    """The scheme that syncs `bucket` (`Bucket.sync`); ValueError, saying how to fix it, when
    no scheme of that name is registered."""
    scheme = SYNC_SCHEMES.get(bucket.sync)
    if scheme is None:
        raise ValueError(
            f"bucket {bucket.index} names sync scheme {bucket.sync!r}, which is not registered "
            f"(registered: {sorted(SYNC_SCHEMES)}); import the module of the layout that "
            f"planned it (the bench's baselines: import wholeshard.bench.baselines)"
        )
    return scheme


def two_level(collectives: Sequence[Collective], node: int) -> list[Collective]:
    """`collectives` with each reduce-scatter and all-gather over the shard group in two stages
    for nodes of `node` ranks ([Note: sync schemes]; `node` 1: unchanged)."""
    if node == 1:
        return list(collectives)
    out = []
    for c in collectives:
        if c.group != "shard" or c.op not in ("reduce_scatter", "all_gather"):
            out.append(c)
            continue
        within = Collective(c.op, node, c.numel, c.dtype, c.what, "node")
        across = Collective(c.op, c.ranks // node, c.numel // node, c.dtype, c.what, "cross")
        out += [within, across] if c.op == "reduce_scatter" else [across, within]
    return out


def unit_reduce(
    buckets: Sequence[Bucket],
    k: int,
    replicas: int,
    rank: int,
    dtype: str,
    node: int = 1,
) -> list[Collective]:
    """The collectives reducing one storage unit's `buckets` on shard index `rank`, in order:
    each bucket's scheme's (in two levels for nodes of `node` ranks), then with `replicas` > 1
    an all-reduce of each of the rank's non-empty shards across the replica group ([Note: sync
    schemes])."""
    out = [c for b in buckets for c in scheme_of(b).reduce(b, k, dtype)]
    out = two_level(out, node)
    if replicas > 1:
        out += [Collective("all_reduce", replicas, n, dtype, "grads", "replica")
                for b in buckets if (n := b.shard_len(rank))]  # fmt: skip
    return out


def unit_gather(
    buckets: Sequence[Bucket],
    k: int,
    dtype: str,
    node: int = 1,
) -> list[Collective]:
    """The collectives gathering one storage unit's `buckets` (k > 1), in order (in two levels
    for nodes of `node` ranks)."""
    gathers = [c for b in buckets for c in scheme_of(b).gather(b, k, dtype)]
    return two_level(gathers, node)


def exchange_batches(buckets: int, every: int | None) -> list[range]:
    """The batches of an exchange buffer's `buckets` (indices, buffer order = reduce order)
    that one all-to-all each way serves: `every` buckets each, or all at once (None)."""
    step = buckets if every is None else every
    return [range(lo, min(lo + step, buckets)) for lo in range(0, buckets, max(step, 1))]


def exchange(
    segments: Sequence[Segment], k: int, rank: int, dtype: str, to_owners: bool
) -> Collective:
    """The all-to-all shard-group rank `rank` issues for one batch's `segments`
    ([Note: exchange buffers] in `_exchange`): the reduced gradients to their owners
    (`to_owners`, grad dtype), or the updated params back to their holders (param dtype)."""
    src, dst = ("holder", "owner") if to_owners else ("owner", "holder")
    sent = [s for s in segments if getattr(s, src) == rank]
    got = [s for s in segments if getattr(s, dst) == rank]
    peers = {getattr(s, dst) for s in sent} | {getattr(s, src) for s in got}
    return Collective(
        "all_to_all",
        k,
        sum(s.numel for s in sent),
        dtype,
        "grads to owners" if to_owners else "params to holders",
        "shard",
        received=sum(s.numel for s in got),
        peers=len(peers),
    )
