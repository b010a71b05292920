"""What the planner reads and writes: `ParamSpec` in, `Bucket`s and `Placement`s out.

Pure data, no torch. `Bucket.owner` is the one owner rule of every buffer: the rank owning
buffer element `i` of a bucket is `(i - bucket.start) // shard_numel`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one parameter."""

    name: str
    shape: tuple[int, ...]
    muon: bool
    tied: bool = False  # the tensor is shared by two modules

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    """Elements `[start, end)` of the buffer, cut into equal shards of `shard_numel`; rank r
    (within the shard group) owns shard r."""

    index: int
    start: int
    end: int
    shard_numel: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard(self, rank: int) -> tuple[int, int]:
        """Buffer range `[start, end)` of rank's shard."""
        lo = self.start + rank * self.shard_numel
        return lo, lo + self.shard_numel

    def owner(self, element: int) -> int:
        """The rank whose shard holds buffer element `element`: the only owner rule."""
        return (element - self.start) // self.shard_numel


@dataclass(frozen=True)
class Placement:
    """Where one param lives: elements `[start, end)` of the buffer, starting in `bucket`."""

    name: str
    shape: tuple[int, ...]
    bucket: int
    start: int
    end: int
    owner: int | None  # `Bucket.owner(start)` in whole-tensor buffers, else None

    @property
    def numel(self) -> int:
        return self.end - self.start


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz cost of one matrix, `max(m, n) * min(m, n) ** 2`; 0 for non-2-D shapes."""
    if len(shape) != 2:
        return 0
    m, n = shape
    return max(m, n) * min(m, n) ** 2


def spec_cost(spec: ParamSpec) -> int:
    """The Newton-Schulz cost the owner of `spec` pays: `ns_cost` for a Muon param, else 0
    (an element-wise AdamW update is negligible next to Newton-Schulz)."""
    return ns_cost(spec.shape) if spec.muon else 0


def cost_imbalance(costs: Sequence[int]) -> float:
    """Max / mean of per-rank Newton-Schulz costs (1.0 when there is no Muon work)."""
    total = sum(costs)
    return 1.0 if total == 0 else max(costs) * len(costs) / total


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is `>= x`."""
    return -(-x // multiple) * multiple
