"""The text `wholeshard plan` prints: first what a user decides on (the run, memory per rank,
the step's projected time and its traffic), then the plan's detail (strategy and why, buckets,
padding, Newton-Schulz balance) and one line per bucket of every buffer. Every figure is the
plan's or its `Costs`' (what `--json` holds); nothing here computes one of its own.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from ..capacity.bucket_hint import BucketSizeHint
from ..capacity.choice import ShardGroupChoice
from ..capacity.costs import Costs, fully_sharded
from ..capacity.projection import FABRICS, GPUS, Projection
from ..capacity.strategy_choice import StrategyChoice
from ..planning import Bucket, Plan
from ..planning.sync import scheme_of

WIDTH = 100
"""Lines are wrapped to this many characters."""
LABEL = 19
"""Width of the labels on the left of the lead and detail lines."""
STRATEGY_WORDS = {
    "balanced": "equal shards, one reduce-scatter and one all-gather per bucket",
    "size_match": "equal shards of size-matched rows, one reduce-scatter and one all-gather per "
    "bucket",
    "owners": "owner buckets, a coalesced reduce and broadcast per bucket (one per owner)",
    "exchange": "one buffer of per-layer equal shards, one reduce-scatter and one all-gather per "
    "bucket, matrices exchanged whole to their owners by one all-to-all each way per batch",
}
"""What each strategy's buckets are, in the words of the table."""


def size(n: int) -> str:
    """`n` bytes in binary units (`1.50 GiB`)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.2f} TiB"


def count(n: int) -> str:
    """`n` elements in decimal units (`8.03B`, `124.4M`)."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if unit in 'TB' else 1}f}{unit}"
    return str(n)


def line(label: str, text: str) -> str:
    """`text` under `label`, wrapped to `WIDTH` with its continuation lines indented."""
    return textwrap.fill(
        text,
        WIDTH,
        initial_indent=f"{label:<{LABEL}}",
        subsequent_indent=" " * LABEL,
        break_on_hyphens=False,
    )


def collectives_of(bucket: Bucket) -> str:
    """The collectives that sync `bucket`, in the words of its sync scheme ([Note: sync
    schemes] in `planning.sync`)."""
    return scheme_of(bucket).words


def headline(plan: Plan, source: str) -> str:
    """The model and the ranks: `llama3-8b: 8.03B params (291 tensors) on 8 ranks, ...`."""
    k, dp = plan.shard_group_size, plan.dp_size
    tensors = sum(len(b.placements) for b in plan.buffers)
    used = sum(b.used for b in plan.buffers)
    if k == dp:
        groups = "one shard group" if dp > 1 else "nothing to shard"
    else:
        groups = f"{dp // k} shard groups of {k} ranks, each shard held {dp // k} times"
    ranks = f"{dp} rank{'s' if dp > 1 else ''}"
    return f"{source}: {count(used)} params ({tensors:,} tensors) on {ranks}, {groups}"


def costs_lines(costs: Costs, assumed: Sequence[str] = ()) -> list[str]:
    """The lead's lines on the mode, memory per rank and traffic ([Note: plan costs]);
    `assumed`: the mode's flags left at their defaults, which the mode line names."""
    mode, k, worst = costs.mode, costs.plan.shard_group_size, costs.worst_rank
    mine = costs.persistent[worst]
    sharded = fully_sharded(costs.plan, mode)
    kind = (
        "fully sharded, each rank keeps its shards"
        if sharded
        else "ZeRO-1/2, full params and grads on every rank"
    )
    flags = (("grad reduce", mode.overlap_grad_reduce), ("param gather", mode.overlap_param_gather))
    overlap = " and ".join(what for what, on in flags if on) or "nothing"
    dtypes = f"params {mode.param_dtype}, grads reduced in {mode.grad_reduce_dtype}"
    if assumed:
        dtypes += f" (the default{'s' if len(assumed) > 1 else ''}: {', '.join(assumed)})"
    names = {"masters": "fp32 masters", "master_grads": "fp32 master grads"}
    kinds = [f"{names.get(n, n.replace('_', ' '))} {size(b)}" for n, b in mine.items()
             if n != "total" and b]  # fmt: skip
    held = f"{size(mine['total'])} between steps"
    if mode.offload_state:
        held += (
            f" ({size(costs.device_bytes(worst))} on the device, "
            f"{size(costs.host_bytes(worst))} of masters and state in host memory)"
        )
    if sharded:
        held += (
            f" + up to {size(costs.peak_transient)} of gathered buckets during a step (the "
            f"largest {size(costs.transient_unit)})"
        )
    least = min(p["total"] for p in costs.persistent)
    who = (
        "every rank alike"
        if least == mine["total"]
        else f"rank {worst} of {k} holds the most; the least {size(least)}"
    )
    counts = ", ".join(f"{n:,} {op}" for op, n in costs.counts().items())
    a2a = costs.bytes_by_op().get("all_to_all")
    exchanged = "" if a2a is None else f"; {size(a2a)} of it in the all-to-alls, rank {worst}'s"
    traffic = (
        f"{size(costs.bytes_sent)} sent per rank in {len(costs.collectives):,} collectives "
        f"({counts}; ring model{exchanged})"
        if costs.collectives
        else "none: one rank"
    )
    return [
        line("mode", f"{kind}; {dtypes}; overlapped: {overlap}"),
        line("memory per rank", f"{held}, before activations: {', '.join(kinds)} ({who})"),
        line("traffic per step", traffic),
    ]


def step_line(projected: Projection | None) -> str:
    """The projection's line, or how to ask for one."""
    if projected is not None:
        return line("step time", projected.describe())
    return line(
        "step time",
        f"not projected: name the network with --fabric ({', '.join(sorted(FABRICS))}) and "
        f"the GPU with --gpu ({', '.join(sorted(GPUS))}; default h100)",
    )


def detail(
    plan: Plan,
    seconds: float,
    choice: ShardGroupChoice | None,
    strategies: StrategyChoice | None = None,
) -> str:
    """The plan's summary: strategy (with `choice`, why; with `strategies`, its step beside the
    others'), shard groups, buckets and bucket size, padding, Newton-Schulz balance, planning
    time."""
    k = plan.shard_group_size
    used = sum(b.used for b in plan.buffers)
    ns = plan.rank_costs()
    strategy = f"strategy {plan.strategy}: {STRATEGY_WORDS.get(plan.strategy, plan.strategy)}"
    if choice is not None:
        strategy += f"; chosen automatically: {choice.reason}"
    ranges = ", ".join(
        f"{len(b.buckets):,} {b.kind} buckets of {min(c.numel for c in b.buckets):,} to "
        f"{max(c.numel for c in b.buckets):,} elements"
        for b in plan.buffers
    )
    total = sum(len(b.buckets) for b in plan.buffers)
    closes = (
        "a bucket closes where a layer ends once it holds that many elements (a layer is a "
        "bucket at the least)"
        if plan.strategy == "exchange"
        else "a bucket closes once it holds about that many elements, an element-wise one also "
        "where a layer ends, and a param wider than that fills one alone"
    )
    buckets = (
        f"{total:,} in {len(plan.buffers)} buffer(s): {ranges}; bucket size "
        f"{plan.bucket_size:,}: {closes}"
    )
    groups = f"dp {plan.dp_size} = {plan.dp_size // k} shard group(s) of {k} ranks"
    if plan.node_size > 1:
        groups += (
            f"; two levels: nodes of {plan.node_size} (each bucket reduce-scattered within the "
            f"node, then across its {k // plan.node_size} nodes; gathered the other way)"
        )
    compared = []
    if strategies is not None:
        compared = [
            line("strategies", strategies.describe()),
            line("group structure", strategies.structure.describe()),
        ]
    return "\n".join([
        line("plan", strategy),
        *compared,
        line("shard groups", groups),
        line("buckets", buckets),
        line("padding", f"{plan.padding_fraction:.3%} ({plan.numel - used:,} of {plan.numel:,} "
                        "elements)"),
        line("Newton-Schulz", f"cost per rank min/mean/max {min(ns):.3g} / {sum(ns) / k:.3g} / "
                              f"{max(ns):.3g}, imbalance {plan.ns_cost_imbalance:.3f}"),
        line("planned in", f"{seconds:.3f} s"),
    ])  # fmt: skip


def bucket_tables(plan: Plan) -> str:
    """One line per bucket of every buffer: range, shards, params, padding, collectives and its
    largest param."""
    lines: list[str] = []
    header = (
        f"  {'bucket':>6} {'start':>17} {'end':>17} {'shards':>15} {'params':>7} "
        f"{'padding':>8}  {'collectives':<26} largest param"
    )
    for index, buffer in enumerate(plan.buffers):
        lines += [
            "",
            f"buffer {index} ({buffer.kind}, {buffer.sharding}): {buffer.numel:,} elements in "
            f"{len(buffer.buckets):,} bucket(s)",
            header,
        ]
        members: list[list[Any]] = [[0, 0, None] for _ in buffer.buckets]  # count, used, widest
        for p in buffer.placements:
            for i in buffer.buckets_of(p):  # a stack may spread over several buckets
                b, m = buffer.buckets[i], members[i]
                m[0] += 1
                m[1] += min(p.end, b.end) - max(p.start, b.start)
                if m[2] is None or p.numel > m[2].numel:
                    m[2] = p
        for b, (n, bucket_used, widest) in zip(buffer.buckets, members, strict=True):
            shape = "x".join(map(str, widest.shape)) or "scalar"
            shards = f"{len(b.owner_starts)} owners" if b.owners else f"{b.shard_numel:,}"
            lines.append(
                f"  {b.index:>6} {b.start:>17,} {b.end:>17,} {shards:>15} {n:>7} "
                f"{1 - bucket_used / b.numel:>8.2%}  {collectives_of(b):<26} {widest.name} "
                f"({shape})"
            )
    return "\n".join(lines)


def plan_table(
    plan: Plan,
    seconds: float,
    source: str,
    costs: Costs | None = None,
    *,
    choice: ShardGroupChoice | None = None,
    projected: Projection | None = None,
    hint: BucketSizeHint | None = None,
    assumed: Sequence[str] = (),
    tp_sent: str | None = None,
    strategies: StrategyChoice | None = None,
) -> str:
    """The whole text: with `costs`, first what a user decides on (the headline, the mode,
    memory per rank, the step time or how to project it, with `hint` (of `projected`) a
    bucket size with less latency, traffic per step and, with `tp_sent`, tensor
    parallelism's), then the plan's summary (with `choice`, why it was
    chosen; with `strategies`, its step beside the other layouts') and one line per bucket of
    every buffer."""
    lines = [headline(plan, source), ""]
    if costs is not None:
        mode, memory, traffic = costs_lines(costs, assumed)
        lines += [mode, memory, step_line(projected)]
        if hint is not None and projected is not None:
            lines.append(line("latency", hint.describe(projected)))
        lines.append(traffic)
        lines += [] if tp_sent is None else [line("tensor parallel", tp_sent)]
        lines.append("")
    return "\n".join([*lines, detail(plan, seconds, choice, strategies), bucket_tables(plan)])
