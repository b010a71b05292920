"""`plan_exactly`: every param of a model placed in buffers, buckets and shards, by exactly the
strategy, bucket size and shard-group size it is told; `Plan` holds it. `auto.plan_for`, the public
planning call, decides those settings (what `DataParallel` makes) and plans through it.

Pure planning: param specs in, plain data out. `specs_by_kind` puts every param in exactly one
buffer of one kind (`buffer`): 2-D matrix-routed params in "matrix" (`_whole`), those with more
dims (fused MoE experts) in "stacked" (`_stacked`), the others in "adamw" (`_elementwise`); with
strategy "exchange", every param in one "exchange" buffer (`_exchange`). A layout ([Note:
layouts] in `layouts`) may rewrite the plan, in buffers of its own kind.

[Note: shard groups]
With `shard_group_size=k` (k divides dp) the dp ranks form dp/k shard groups of k consecutive
ranks (global rank g*k + r is rank r of group g). Every group uses the same plan: owners and
shards are numbered 0..k-1 within the group, gradients are reduce-scattered within a group and
all-reduced across groups. `Plan.shard_rank(rank)` maps a global rank to its shard index in the
group: its rank in the group, unless the group has two levels.

[Note: two-level groups]
With `node_size=n` (the ranks of a node: consecutive global ranks, as torchrun numbers them)
and a shard group of k = m x n ranks spanning m nodes, each equal-shard bucket (schemes
"equal_shards" and "exchange") reduces in two stages: a reduce-scatter of the whole bucket
within the node (n ranks, fast links), after which local rank l holds the node's sums of chunk l
of n, then a reduce-scatter of that chunk across the m nodes (the m ranks of local rank l, one
per node, each through its own NIC), after which the rank on node j holds sub-chunk j of chunk
l: shard l*m + j, its shard index (`Plan.shard_rank`; `Plan.group_rank` inverts it). Gathers
run the other way: across nodes, then within. Only 1/n of the bucket crosses a node boundary per
rank, and each stage's ring is a node or a node count long: the latency of k - 1 hops becomes
(n - 1) + (m - 1). Everything else (owners, exchange peers, checkpoints) follows the shard
index, so a two-level plan is the one-level plan with its shards dealt to other ranks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from ._elementwise import plan_elementwise
from ._owners import plan_owned
from ._stacked import plan_stacked
from ._whole import plan_whole
from .buffer import KINDS, LAYOUT_KINDS, Buffer, BufferKind
from .specs import MatrixCost, ParamSpec, cost_imbalance, is_int

Strategy = Literal["auto", "balanced", "owners", "size_match", "exchange"]
STRATEGIES: tuple[Strategy, ...] = ("auto", "balanced", "owners", "size_match", "exchange")
DEFAULT_STRATEGY: Strategy = "auto"
"""What `DataParallel`, `wholeshard plan`, the train job and `auto.plan_for` use (`plan_for`
resolves it); `plan_exactly` plans one named strategy and defaults to "balanced"."""
TWO_LEVEL_SCHEMES = ("equal_shards", "exchange")
"""The sync schemes two-level groups run: reduce-scatters and all-gathers of equal shards."""


@dataclass(frozen=True)
class Plan:
    """Every param's buffer, bucket, range and owner, for `dp_size` ranks in shard groups of
    `shard_group_size`. `buffers` holds at most one buffer per kind, in `KINDS` order, none
    empty. `bucket_size` is the one planned: elements, or `ONE_BUCKET`. `matrix_cost` is the
    cost the plan balanced (None: Newton-Schulz cost)."""

    dp_size: int
    shard_group_size: int
    strategy: Strategy
    align: int
    bucket_size: int | float
    buffers: tuple[Buffer, ...]
    matrix_cost: MatrixCost | None = field(default=None, compare=False, repr=False)
    node_size: int = 1  # ranks per node of a two-level group ([Note: two-level groups]); 1: one

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buffers)

    @property
    def padding_fraction(self) -> float:
        """Padded elements / all buffer elements, over all buffers."""
        total = self.numel
        return 0.0 if total == 0 else 1.0 - sum(b.used for b in self.buffers) / total

    def rank_costs(self) -> list[int]:
        """The cost the plan balanced (`matrix_cost`; None: Newton-Schulz cost, `ns_cost`) of
        the Muon matrices each shard-group rank owns."""
        costs = [0] * self.shard_group_size
        for buffer in self.buffers:
            for rank, cost in enumerate(buffer.rank_costs(self.matrix_cost)):
                costs[rank] += cost
        return costs

    @property
    def ns_cost_imbalance(self) -> float:
        """Max over shard-group ranks of owned cost (`rank_costs`: Newton-Schulz cost unless the
        plan balanced another `matrix_cost`) / mean (1.0: no Muon work)."""
        return cost_imbalance(self.rank_costs())

    def shard_rank(self, rank: int) -> int:
        """The shard index of global rank `rank` within its shard group ([Note: shard groups]):
        its rank in the group, or with two levels local * nodes + node ([Note: two-level
        groups])."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} is not in 0..{self.dp_size - 1}")
        return shard_index(rank % self.shard_group_size, self.shard_group_size, self.node_size)

    def group_rank(self, shard: int) -> int:
        """The rank within its shard group that holds shard index `shard` (`shard_rank`'s
        inverse within a group)."""
        return shard_holder(shard, self.shard_group_size, self.node_size)

    def sync_schemes(self) -> set[str]:
        """The names of the sync schemes its buckets name ([Note: sync schemes] in `sync`)."""
        return {bk.sync for b in self.buffers for bk in b.buckets}

    def two_level_ready(self) -> bool:
        """Whether every bucket is reduce-scattered and all-gathered ([Note: two-level
        groups]): its buckets' schemes are `TWO_LEVEL_SCHEMES`."""
        return self.sync_schemes() <= set(TWO_LEVEL_SCHEMES)

    def check(self, specs: Sequence[ParamSpec] | None = None) -> None:
        """Raise AssertionError if any buffer breaks an invariant; with `specs` (registration
        order) also check every spec sits once in the buffer of its kind, in order."""
        k, n = self.shard_group_size, self.node_size
        if not (self.dp_size >= 1 and k >= 1 and self.dp_size % k == 0):
            raise AssertionError(f"shard_group_size {k} must divide dp_size {self.dp_size}")
        if n != 1 and not (1 < n < k and k % n == 0 and self.two_level_ready()):
            raise AssertionError(f"node_size {n}: two levels need 1 < n < k = {k}, n | k, "
                                 "and equal-shard buckets")  # fmt: skip
        kinds = [b.kind for b in self.buffers]
        own = [kind for kind in kinds if kind in LAYOUT_KINDS]  # a layout's: every param
        if kinds != ([kind for kind in KINDS if kind in kinds] if not own else own[:1]):
            raise AssertionError(
                f"buffers {kinds}: at most one per kind, in the order {KINDS}, or one of a "
                f"layout's kind alone"
            )
        for b in self.buffers:
            if b.shard_group_size != k or b.align != self.align:
                raise AssertionError(
                    f"{b.kind} buffer has shard_group_size {b.shard_group_size} and align "
                    f"{b.align}, the plan {k} and {self.align}"
                )
            if not b.placements:
                raise AssertionError(f"{b.kind} buffer holds no params; leave it out")
        by_kind: dict[BufferKind, list[ParamSpec]] | None = None
        if specs is not None:
            by_kind = {own[0]: list(specs)} if own else specs_by_kind(specs, self.strategy)
        for b in self.buffers:
            b.check(None if by_kind is None else by_kind.get(b.kind, []))
        placed = sum(len(b.placements) for b in self.buffers)
        if specs is not None and placed != len(specs):
            raise AssertionError(f"{len(specs)} specs but {placed} placements")


def shard_index(group_rank: int, k: int, node_size: int) -> int:
    """The shard index of rank `group_rank` of a shard group of `k` in nodes of `node_size`
    ([Note: two-level groups]): local rank x nodes + node."""
    return (group_rank % node_size) * (k // node_size) + group_rank // node_size


def shard_holder(shard: int, k: int, node_size: int) -> int:
    """The rank of a shard group of `k` in nodes of `node_size` that holds shard index `shard`
    (`shard_index`'s inverse)."""
    nodes = k // node_size
    return (shard % nodes) * node_size + shard // nodes


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


ONE_BUCKET: Final[float] = math.inf
"""`plan_exactly(..., bucket_size=ONE_BUCKET)`: one bucket per buffer (or per run between tied
params). A bucket size is an int or this, never None: None is `plan_for`'s default size."""


def plan_exactly(
    params: Sequence[ParamSpec],
    dp_size: int,
    *,
    bucket_size: int | float,
    align: int = 64,
    strategy: Strategy = "balanced",
    shard_group_size: int | None = None,
    matrix_cost: MatrixCost | None = None,
    node_size: int | None = None,
) -> Plan:
    """Plan the buffers for `params` (registration order) on `dp_size` ranks in shard groups of
    `k = shard_group_size or dp_size` with exactly these settings: nothing is chosen here
    (`auto.plan_for` chooses, as `DataParallel` does, and resolves strategy "auto"). "balanced"
    and "owners" balance `matrix_cost` (None: Newton-Schulz cost). `bucket_size`: an int, or
    `ONE_BUCKET`. `node_size`: the ranks of a node, for two-level groups where a
    shard group spans several nodes ([Note: two-level groups]; None: one level). Raises
    ValueError, saying how to fix it, on bad input; the result passes `Plan.check(params)`."""
    specs = tuple(params)
    validate_specs(specs)
    if bucket_size != ONE_BUCKET and not (is_int(bucket_size) and bucket_size > 0):
        raise ValueError(
            f"plan_exactly plans the bucket size it is told: pass an int > 0 (elements) or "
            f"ONE_BUCKET (one bucket per buffer), got {bucket_size!r}; for DataParallel's "
            "default size use wholeshard.planning.plan_for"
        )
    size = None if bucket_size == ONE_BUCKET else int(bucket_size)
    k = _group_size(dp_size, shard_group_size, size, align, strategy)
    if strategy == "auto":
        raise ValueError(
            "strategy='auto' chooses between plans: use wholeshard.planning.plan_for (what "
            "DataParallel uses), or name one of 'balanced', 'owners', 'size_match', 'exchange'"
        )
    by_kind = specs_by_kind(specs, strategy)
    buffers = tuple(
        plan_buffer(kind, tuple(by_kind[kind]), k, size, align, strategy, matrix_cost)
        for kind in KINDS
        if kind in by_kind
    )
    plan = Plan(dp_size, k, strategy, align, bucket_size, buffers, matrix_cost)
    plan = two_level(plan, node_size)
    plan.check(specs)
    return plan


def two_level(plan: Plan, node_size: int | None) -> Plan:
    """`plan` with its shard groups in two levels of `node_size` ranks a node where they span
    several nodes ([Note: two-level groups]), else one level; ValueError, saying how to fix it,
    where they cannot be."""
    if node_size is None:
        return dataclasses.replace(plan, node_size=1)
    if not is_int(node_size) or node_size < 1:
        raise ValueError(
            f"node_size must be None or an int >= 1 (the ranks of a node, torchrun's "
            f"--nproc-per-node), got {node_size!r}"
        )
    k = plan.shard_group_size
    if k <= node_size:  # each shard group within a node (or straddling two): one level
        return dataclasses.replace(plan, node_size=1)
    if k % node_size:
        raise ValueError(
            f"node_size={node_size} does not divide the shard group size {k}: a two-level group "
            f"is whole nodes; pass the ranks of a node that divide it, or a shard_group_size "
            f"that is a multiple of {node_size}"
        )
    if not plan.two_level_ready():
        others = sorted(plan.sync_schemes() - set(TWO_LEVEL_SCHEMES))
        fix = "pass strategy='exchange' (or 'balanced'), or " if "owners" in others else ""
        raise ValueError(
            f"node_size={node_size}: two-level groups reduce-scatter and all-gather equal-shard "
            f"buckets (sync schemes {TWO_LEVEL_SCHEMES}), and this plan syncs buckets by "
            f"{', '.join(map(repr, others))}; {fix}leave node_size unset"
        )
    return dataclasses.replace(plan, node_size=node_size)


def plan_buffer(
    kind: BufferKind,
    specs: tuple[ParamSpec, ...],
    k: int,
    bucket_size: int | None,
    align: int,
    strategy: Strategy,
    matrix_cost: MatrixCost | None = None,
) -> Buffer:
    """The buffer of one of `KINDS` of validated `specs` over `k` ranks, planned by
    `strategy` (not "auto"), not yet checked; `bucket_size` None: one bucket (the private
    planners' spelling of `ONE_BUCKET`)."""
    if kind == "adamw":
        return plan_elementwise(specs, k, bucket_size, align)
    if strategy == "owners" or kind == "exchange":
        return plan_owned(kind, specs, k, bucket_size, align, matrix_cost)
    if kind == "stacked":
        return plan_stacked(specs, k, bucket_size, align)
    return plan_whole(specs, k, strategy, bucket_size, align, matrix_cost)


def specs_by_kind(
    specs: Sequence[ParamSpec], strategy: str = "balanced"
) -> dict[BufferKind, list[ParamSpec]]:
    """`specs` grouped by the kind of buffer each goes to (with the default scheme) under
    `strategy`, each group in registration order."""
    if strategy == "exchange":
        return {"exchange": list(specs)} if specs else {}
    by_kind: dict[BufferKind, list[ParamSpec]] = {}
    for s in specs:
        kind: BufferKind = "adamw" if not s.matrix else "stacked" if len(s.shape) > 2 else "matrix"
        by_kind.setdefault(kind, []).append(s)
    return by_kind


def _group_size(
    dp_size: int, k: int | None, bucket_size: int | None, align: int, strategy: str
) -> int:
    """The shard group size the options ask for (`k`, None: `dp_size`), once they are valid
    (`bucket_size` None: chosen by the caller, or one bucket); ValueError, saying how to fix
    it, otherwise."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not is_int(dp_size) or dp_size < 1:
        raise ValueError(
            f"dp_size must be an int >= 1 (the data-parallel world size), got {dp_size!r}"
        )
    if not is_int(align) or align < 1:
        raise ValueError(f"align must be an int >= 1 (elements; 64 is typical), got {align!r}")
    if bucket_size is not None and (not is_int(bucket_size) or bucket_size <= 0):
        raise ValueError(
            f"bucket_size must be None (the default size) or an int > 0 (elements), got "
            f"{bucket_size!r}"
        )
    if k is None:
        return dp_size
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or dp_size % k:
        divisors = [d for d in range(1, dp_size + 1) if dp_size % d == 0]
        raise ValueError(
            f"shard_group_size must be an int dividing dp_size={dp_size} (params are sharded "
            f"within groups of that many ranks and replicated across groups), got {k!r}; "
            f"choose one of {divisors}"
        )
    return k


def validate_specs(specs: Sequence[ParamSpec]) -> None:
    """Raise ValueError, saying how to fix it, for specs no plan can serve: the one validator of
    specs (shapes files report `shape_problem` with their own context)."""
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, ParamSpec):
            raise ValueError(f"expected ParamSpec, got {type(spec).__name__}: {spec!r}")
        if spec.name in seen:
            raise ValueError(
                f"duplicate param name {spec.name!r}; give each param a unique name (its FQN) "
                "and list a shared tensor only once, with tied=True"
            )
        seen.add(spec.name)
        shape = spec.shape
        if type(shape) is tuple and all(type(d) is int and d > 0 for d in shape):
            continue  # the common case, checked fast
        if not isinstance(shape, tuple) or not all(is_int(d) for d in shape):
            raise ValueError(
                f"param {spec.name!r}: shape must be a tuple of ints (e.g. tuple(p.shape)), "
                f"got {shape!r}"
            )
        problem = shape_problem(shape)
        if problem is not None:
            raise ValueError(f"param {spec.name!r}: {problem}")


def shape_problem(shape: Sequence[int]) -> str | None:
    """Why a shape of ints cannot be a planned param's, or None."""
    if any(d < 0 for d in shape):
        return f"shape {shape} has a negative size"
    if any(d == 0 for d in shape):
        return (
            f"shape {shape} has no elements; leave zero-element params out of the plan "
            "(they have nothing to sync)"
        )
    return None
