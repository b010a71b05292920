"""Multi-buffer plans: Muon params in whole-tensor buffers, AdamW params in element-wise ones.

Pure planning, like `layout`: param specs in, plain data out. One routing decision
(`ParamSpec.muon`) puts every param in exactly one buffer, a `Layout` of one kind
(`wholeshard._planning.buffer`, which also checks each kind's invariants):

- `"muon"` buffer: a `Layout` (size-matching or balanced) over the shard group's `k` ranks.
  Every param lies wholly inside one shard; its `owner` is a rank within the shard group.
- `"stacked"` buffer: Muon params with more than 2 dims (fused MoE experts), each a stack of
  matrices; every matrix lies wholly inside one shard and a stack spreads over consecutive
  shards (`wholeshard._stacks`, [Note: stacked layout]). Placements have `owner` None; each
  matrix's owner follows from its offset.
- `"adamw"` buffer: element-wise sharded. Params are packed in backprop order (reverse
  registration order), each starting on an `align`-element boundary, and cut into buckets that
  close once they hold `>= bucket_size` elements; each bucket is then padded to a multiple of
  `k * align`, so its `k` equal shards start aligned. Rank r owns the contiguous r-th shard of
  every bucket, so a param may straddle shards (`owner` is None), and the only padding is
  alignment (< `align` per param) plus < `k * align` per bucket: a tied embedding costs nothing.

[Note: shard groups]
With `shard_group_size=k` (k divides dp) the dp ranks form dp/k shard groups of k consecutive
ranks (global rank g*k + r is rank r of group g). Every group uses the same plan: owners and
shards are numbered 0..k-1 within the group, gradients are reduce-scattered within a group and
all-reduced across groups. `Plan.shard_rank(rank)` maps a global rank to its rank in the group.

Why params in element-wise buffers start aligned: every param view then starts on a 64-element
(128-byte at bf16) boundary, as in whole-tensor buffers, which vectorised kernels and the
32-element MXFP8 blocks of later FP8 work rely on; it costs < `align` elements per param.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._planning.buffer import KINDS
from ._planning.records import cost_imbalance, ns_cost, round_up
from ._stacks import matrices, matrix_shape, plan_stacked
from .layout import Bucket, Layout, ParamSpec, Placement, place, validate_inputs

DEFAULT_STRATEGY = "balanced"


@dataclass(frozen=True)
class Plan:
    """Every param's buffer, bucket, range and owner, for `dp_size` ranks in shard groups of
    `shard_group_size`. `buffers` holds at most one buffer per kind ("muon" first), none empty."""

    dp_size: int
    shard_group_size: int
    strategy: str
    align: int
    bucket_size: int | None
    buffers: tuple[Layout, ...]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buffers)

    @property
    def padding_fraction(self) -> float:
        """Padded elements / all buffer elements, over all buffers."""
        total = self.numel
        return 0.0 if total == 0 else 1.0 - sum(b.used for b in self.buffers) / total

    def rank_costs(self) -> list[int]:
        """Newton-Schulz cost (`ns_cost`) of the Muon params each shard-group rank owns."""
        costs = [0] * self.shard_group_size
        for buffer in self.buffers:
            if buffer.whole:
                for p in buffer.placements:
                    costs[p.owner] += ns_cost(p.shape)
            elif buffer.kind == "stacked":
                for p in buffer.placements:
                    cost = ns_cost(matrix_shape(p.shape))
                    for m in matrices(p, buffer.buckets):
                        costs[m.owner] += cost
        return costs

    @property
    def ns_cost_imbalance(self) -> float:
        """Max over shard-group ranks of owned Newton-Schulz cost / mean (1.0: no Muon work)."""
        return cost_imbalance(self.rank_costs())

    def shard_rank(self, rank: int) -> int:
        """The rank within its shard group of global rank `rank` (see [Note: shard groups])."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} is not in 0..{self.dp_size - 1}")
        return rank % self.shard_group_size

    def check(self, specs: Sequence[ParamSpec] | None = None) -> None:
        """Raise AssertionError if any buffer breaks an invariant; with `specs` (registration
        order) also check every spec sits once in the buffer of its kind, in order."""
        k = self.shard_group_size
        assert self.dp_size >= 1 and k >= 1 and self.dp_size % k == 0, (
            f"shard_group_size {k} must divide dp_size {self.dp_size}"
        )
        kinds = [b.kind for b in self.buffers]
        assert kinds == [kind for kind in KINDS if kind in kinds], (
            f"buffers {kinds}: at most one per kind, 'muon' first"
        )
        for b in self.buffers:
            assert b.shard_group_size == k and b.align == self.align, (
                f"{b.kind} buffer has shard_group_size {b.shard_group_size} and align "
                f"{b.align}, the plan {k} and {self.align}"
            )
            assert b.placements, f"{b.kind} buffer holds no params; leave it out"
        if specs is None:
            for b in self.buffers:
                b.check()
            return
        for b in self.buffers:
            mine = [s for s in specs if _kind(s) == b.kind]
            b.check(mine)
        placed = sum(len(b.placements) for b in self.buffers)
        assert placed == len(specs), f"{len(specs)} specs but {placed} placements"


DEFAULT_BUCKETS = 8
"""How many buckets `default_bucket_size` aims for: overlap needs several, each a collective."""
MIN_BUCKET_SIZE = 1 << 16
"""Below this many elements a collective's fixed cost outweighs its bytes."""


def default_bucket_size(numel: int, dp_size: int) -> int:
    """Elements per bucket when none is given, for `numel` params over `dp_size` ranks.

    About `DEFAULT_BUCKETS` buckets, so a reduce-scatter can start while backward runs and a
    gather while forward runs, but never below `MIN_BUCKET_SIZE` and never above Megatron's
    bucket size, `max(40M, 1M x dp)` elements (which keeps each rank's shard at >= 1M elements
    on large runs). torch DDP's default, 25 MB of fp32 gradients, is 6.5M elements.
    """
    megatron = max(40_000_000, 1_000_000 * dp_size)
    return min(max(-(-numel // DEFAULT_BUCKETS), MIN_BUCKET_SIZE), megatron)


def plan_buffers(
    params: Sequence[ParamSpec],
    dp_size: int,
    *,
    bucket_size: int | None = None,
    align: int = 64,
    strategy: str = DEFAULT_STRATEGY,
    shard_group_size: int | None = None,
) -> Plan:
    """Plan the buffers for `params` (registration order) on `dp_size` ranks.

    Muon params (`spec.muon`) go to a whole-tensor buffer planned as by `plan_layout(...,
    strategy=strategy)` over `k = shard_group_size or dp_size` ranks; the others to an
    element-wise buffer (module docstring). Both cut buckets near `bucket_size` elements (None:
    one bucket per buffer). Raises ValueError on bad input; the result passes
    `Plan.check(params)`.
    """
    specs = tuple(params)
    k = dp_size if shard_group_size is None else shard_group_size
    validate_inputs(specs, dp_size, bucket_size, align, strategy)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or dp_size % k:
        divisors = [d for d in range(1, dp_size + 1) if dp_size % d == 0]
        raise ValueError(
            f"shard_group_size must be an int dividing dp_size={dp_size} (params are sharded "
            f"within groups of that many ranks and replicated across groups), got {k!r}; "
            f"choose one of {divisors}"
        )
    buffers = []
    muon = [s for s in specs if _kind(s) == "muon"]
    if muon:
        buffers.append(place(tuple(muon), k, bucket_size, align, strategy))  # checked below
    stacked = [s for s in specs if _kind(s) == "stacked"]
    if stacked:
        buffers.append(Layout("stacked", k, align, *plan_stacked(stacked, k, bucket_size, align)))
    adamw = [s for s in specs if not s.muon]
    if adamw:
        buffers.append(_plan_elementwise(adamw, k, bucket_size, align))
    plan = Plan(dp_size, k, strategy, align, bucket_size, tuple(buffers))
    plan.check(specs)
    return plan


def _kind(spec: ParamSpec) -> str:
    if not spec.muon:
        return "adamw"
    return "stacked" if len(spec.shape) > 2 else "muon"


def _plan_elementwise(
    specs: Sequence[ParamSpec], k: int, bucket_size: int | None, align: int
) -> Layout:
    """Pack `specs` in backprop order into buckets of `k` equal aligned shards."""
    n = len(specs)
    placements: list[Placement | None] = [None] * n
    buckets: list[Bucket] = []
    start = 0  # of the open bucket
    cursor = 0  # where the next param goes
    for i in range(n - 1, -1, -1):
        spec = specs[i]
        placements[i] = Placement(
            spec.name, tuple(spec.shape), len(buckets), cursor, cursor + spec.numel, None
        )
        cursor = round_up(cursor + spec.numel, align)
        if i == 0 or (bucket_size is not None and cursor - start >= bucket_size):
            end = start + round_up(cursor - start, k * align)
            buckets.append(Bucket(len(buckets), start, end, (end - start) // k))
            start = cursor = end
    return Layout("adamw", k, align, tuple(buckets), tuple(placements))  # type: ignore[arg-type]
