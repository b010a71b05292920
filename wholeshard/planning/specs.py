"""What the planner reads and writes: `ParamSpec` in, `Bucket`s and `Placement`s out, and the
matrices of a stacked param. Pure data, no torch.

`Bucket.owner` is the one owner rule of every sharded buffer: the rank owning buffer element `i`
of a bucket is the rank whose shard holds it, `(i - bucket.start) // shard_numel` for equal
shards, or the last listed owner starting at or before `i` in an owner bucket.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

MatrixCost = Callable[[int, int], int]
"""`cost(rows, cols)`: what the owner of one (rows, cols) matrix pays per step under an
optimizer rule (its `matrix_cost`, `DataParallelConfig.matrix_cost`); the planner balances it.
None wherever one is taken: `newton_schulz_cost`."""


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one parameter."""

    name: str
    shape: tuple[int, ...]
    matrix: bool
    tied: bool = False  # the tensor is shared by two modules

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)


_LAYER = re.compile(r"^(.*?\.\d+)\.")  # a name's prefix up to its first numbered module


def layer_of(name: str) -> str | None:
    """The layer a param belongs to: its name's prefix up to the first numbered module
    (`model.layers.7.mlp.experts.3.up.weight` -> `model.layers.7`); None outside numbered
    modules (embeddings, final norm, head)."""
    match = _LAYER.match(name)
    return match.group(1) if match else None


@dataclass(frozen=True)
class Bucket:
    """Elements `[start, end)` of the buffer, cut into one shard per rank of the shard group;
    rank r (within the group) owns shard r.

    [Note: owner buckets]
    A bucket either has `k` equal shards of `shard_numel` (its gradients are reduce-scattered
    and its params all-gathered: one collective each, what NCCL needs equal sizes for), or it is
    an owner bucket: `owner_starts` lists `(rank, start)` of every rank with a non-empty shard,
    ranks and starts ascending, the first at the bucket's start; a rank's shard runs to the next
    listed start (or the bucket's end), and an unlisted rank's shard is empty (`shard_numel` is
    0). An owner bucket's gradients go to each listed owner by a reduce of its shard and its
    params leave by a broadcast of it: the same bytes per rank as a reduce-scatter and an
    all-gather, with no equal-shard constraint, so no padding and no minimum size (a bucket of
    whole matrices over k equal shards holds at least k times its widest one). Only the owners
    are listed, so a bucket costs the same at 8 ranks as at 1024.

    An exchange bucket (`exchanged`, [Note: exchange buffers] in `_exchange`) has equal shards
    whose holders are not the owners of its matrices: `owner` names the shard's holder there,
    and `Placement.owners` the rank that steps each matrix.
    """

    index: int
    start: int
    end: int
    shard_numel: int
    owner_starts: tuple[tuple[int, int], ...] = ()
    exchanged: bool = False
    scheme: str = ""  # a registered sync scheme syncing it instead ([Note: layouts] in `layouts`)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def owners(self) -> bool:
        """Whether this is an owner bucket ([Note: owner buckets])."""
        return bool(self.owner_starts)

    @property
    def sync(self) -> str:
        """The name of the scheme that syncs this bucket ([Note: sync schemes] in `sync`): the
        one it names (`scheme`, registered by a layout), else "owners" for an owner bucket,
        "exchange" for an exchange bucket, and "equal_shards"."""
        if self.scheme:
            return self.scheme
        if self.exchanged:
            return "exchange"
        return "owners" if self.owner_starts else "equal_shards"

    def shard(self, rank: int) -> tuple[int, int]:
        """Buffer range `[start, end)` of rank's shard (empty: `start == end`)."""
        if not self.owner_starts:
            lo = self.start + rank * self.shard_numel
            return lo, lo + self.shard_numel
        listed = self.owner_starts
        i = bisect.bisect_left(listed, rank, key=operator.itemgetter(0))
        if i == len(listed):
            return self.end, self.end
        lo = listed[i][1]
        if listed[i][0] != rank:
            return lo, lo
        return lo, listed[i + 1][1] if i + 1 < len(listed) else self.end

    def shard_len(self, rank: int) -> int:
        """Elements in rank's shard."""
        lo, hi = self.shard(rank)
        return hi - lo

    def shards(self) -> Iterator[tuple[int, int, int]]:
        """`(rank, start, end)` of every non-empty shard, by rank."""
        ranks = [r for r, _ in self.owner_starts] or range(self.numel // self.shard_numel)
        for rank in ranks:
            yield rank, *self.shard(rank)

    def owner(self, element: int) -> int:
        """The rank whose shard holds buffer element `element`: the only owner rule (in an
        exchange bucket, the holder: matrices are owned by `Placement.owners`)."""
        if self.owner_starts:
            i = bisect.bisect_right(self.owner_starts, element, key=operator.itemgetter(1))
            return self.owner_starts[i - 1][0]
        return (element - self.start) // self.shard_numel


@dataclass(frozen=True)
class Placement:
    """Where one param lives: elements `[start, end)` of the buffer, starting in `bucket`."""

    name: str
    shape: tuple[int, ...]
    bucket: int
    start: int
    end: int
    owner: int | None  # the rank that updates the param whole; None where pieces are owned
    owners: tuple[int, ...] = ()
    """In an exchange buffer, the rank that steps each matrix of a Muon param (one for a 2-D
    param, one per matrix of a stack); empty for element-wise params and in other buffers."""

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Matrix:
    """Matrix `index` of a stacked param: buffer elements `[start, end)`, in `bucket`."""

    index: int
    start: int
    end: int
    bucket: int
    owner: int


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The shape of one matrix of a stack: its last two dims."""
    return int(shape[-2]), int(shape[-1])


def matrix_count(shape: Sequence[int]) -> int:
    """How many matrices a stack holds: the product of its leading dims."""
    return math.prod(shape[:-2])


def matrices(placement: Placement, buckets: Sequence[Bucket]) -> Iterator[Matrix]:
    """Every matrix of a stacked `placement`, in order, with its bucket and owner."""
    unit = math.prod(matrix_shape(placement.shape))
    b = placement.bucket
    for index in range(matrix_count(placement.shape)):
        start = placement.start + index * unit
        while start >= buckets[b].end:
            b += 1
        yield Matrix(index, start, start + unit, b, buckets[b].owner(start))


def iterate_sharded_dim(shape: tuple[int, ...], shard_dim: int) -> int:
    """Which dim of Newton–Schulz's iterate (the matrix turned so rows <= cols) is split, for a
    matrix of logical `shape` split on `shard_dim` (tensor parallel)."""
    return 1 - shard_dim if shape[0] > shape[1] else shard_dim


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz cost of one matrix, `max(m, n) * min(m, n) ** 2`; 0 for non-2-D shapes."""
    if len(shape) != 2:
        return 0
    m, n = shape
    return max(m, n) * min(m, n) ** 2


def newton_schulz_cost(rows: int, cols: int) -> int:
    """`ns_cost` of a (rows, cols) matrix: the default `MatrixCost` (Muon's rules' own)."""
    return ns_cost((rows, cols))


def shape_cost(shape: Sequence[int], matrix_cost: MatrixCost | None = None) -> int:
    """`matrix_cost(m, n)` of an (m, n) shape (None: `ns_cost`); 0 for non-2-D shapes."""
    if len(shape) != 2:
        return 0
    return ns_cost(shape) if matrix_cost is None else int(matrix_cost(*shape))


def spec_cost(spec: ParamSpec, matrix_cost: MatrixCost | None = None) -> int:
    """The cost the owner of `spec` pays: `shape_cost` for a Muon param, else 0 (an
    element-wise AdamW update is negligible next to a matrix rule's)."""
    return shape_cost(spec.shape, matrix_cost) if spec.matrix else 0


def cost_imbalance(costs: Sequence[int]) -> float:
    """Max / mean of per-rank matrix costs (1.0 when there is no Muon work)."""
    total = sum(costs)
    return 1.0 if total == 0 else max(costs) * len(costs) / total


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is `>= x`."""
    return -(-x // multiple) * multiple


def is_int(x: object) -> bool:
    """Whether `x` is an integer (Python or numpy; not a bool)."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True
