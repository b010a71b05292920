"""`wholeshard plan`: plan the buffers of a model given by shapes alone (a shapes file,
`capacity.shapes`, or a preset), and show the plan and what it costs each rank in the mode the
flags name (`capacity.costs`): persistent bytes by kind, the peak of transient full buckets, one
step's collectives and bytes sent; with `--fabric`, a projection of the step's communication and
optimizer time (`capacity.projection`). Exit codes: 0 planned, 2 bad input (argparse errors, an
unreadable or malformed shapes file, a model no torch process could hold, a model no plan can
serve).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..capacity.choice import ShardGroupChoice, plan_and_choice
from ..capacity.costs import Costs, Mode, fully_sharded, plan_costs
from ..capacity.presets import PRESETS
from ..capacity.projection import FABRICS, GPUS, project
from ..capacity.shapes import load_shapes
from ..capacity.tp_traffic import TP_MODES, local_specs, ns_traffic
from ..planning import DEFAULT_STRATEGY, STRATEGIES, Bucket, ParamSpec, Plan
from ..planning.specs import matrices
from . import positive_int

MAX_DP = 1 << 20
"""Largest `--dp`: beyond any cluster, and the plan keeps per-rank tables."""
DTYPES = ("float32", "bfloat16", "float16")
"""The choices of `--param-dtype` and `--grad-reduce-dtype`."""
MODE_FIELDS = ("reshard_after_forward", "param_dtype", "grad_reduce_dtype", "overlap_grad_reduce",
               "overlap_param_gather", "param_sync", "clip_grad_norm")  # fmt: skip
"""The `Mode` fields the JSON's `mode` echoes (with the plan's `shard_group_size`)."""


def costs_json(costs: Costs) -> dict[str, Any]:
    """`mode`, `per_rank` and `per_step` of the `--json` document ([Note: plan costs]):
    persistent bytes by kind of the shard-group rank holding the most, the peak of transient
    full buckets, and one step's collectives by op and bytes sent per rank."""
    mode, worst = costs.mode, costs.worst_rank
    return {
        "mode": {name: getattr(mode, name) for name in MODE_FIELDS}
        | {"shard_group_size": costs.plan.shard_group_size},
        "per_rank": {
            "shard_rank": worst,
            "persistent_bytes": costs.persistent[worst],
            "persistent_total_min": min(p["total"] for p in costs.persistent),
            "peak_transient_bytes": costs.peak_transient,
            "transient_unit_bytes": costs.transient_unit,
        },
        "per_step": {
            "collectives": costs.counts(),
            "bytes_sent": costs.bytes_sent,
            "bytes_sent_by_op": costs.bytes_by_op(),
        },
    }


def plan_json(
    plan: Plan, specs: Sequence[ParamSpec], seconds: float, costs: Costs | None = None
) -> dict[str, Any]:
    """The `--json` document: plan summary, buffers with their buckets, the params in the
    order of `specs` (the specs `plan` was planned from), and with `costs` (of this plan) their
    `mode`, `per_rank` and `per_step` (`costs_json`)."""
    where = {p.name: (i, b, p) for i, b in enumerate(plan.buffers) for p in b.placements}
    params = []
    for spec in specs:
        index, buffer, p = where[spec.name]
        entry = {
            "name": p.name,
            "shape": list(p.shape),
            "kind": buffer.kind,
            "buffer": index,
            "bucket": p.bucket,
            "start": p.start,
            "end": p.end,
            "owner": p.owner,
        }
        if buffer.kind == "stacked":  # the owner of each matrix, in order
            entry["matrix_owners"] = [m.owner for m in matrices(p, buffer.buckets)]
        params.append(entry)
    return {
        "dp": plan.dp_size,
        "strategy": plan.strategy,
        "shard_group_size": plan.shard_group_size,
        "bucket_size": plan.bucket_size,
        "padding_fraction": plan.padding_fraction,
        "ns_cost_imbalance": plan.ns_cost_imbalance,
        "plan_seconds": seconds,
        "buffers": [
            {"kind": b.kind, "numel": b.numel, "buckets": [bucket_json(c) for c in b.buckets]}
            for b in plan.buffers
        ],
        "params": params,
        **(costs_json(costs) if costs is not None else {}),
    }


def collectives_of(bucket: Bucket) -> str:
    """The collectives that sync `bucket` ([Note: owner buckets] in `planning.specs`)."""
    return "reduce/broadcast" if bucket.owners else "reduce_scatter/all_gather"


def bucket_json(bucket: Bucket) -> dict[str, Any]:
    """One bucket of the `--json` document: its range, its shards, and its collectives."""
    out = {"start": bucket.start, "end": bucket.end, "shard_numel": bucket.shard_numel}
    out["collectives"] = collectives_of(bucket)
    if bucket.owners:
        out["owner_starts"] = [list(entry) for entry in bucket.owner_starts]
    return out


def choice_json(choice: ShardGroupChoice) -> dict[str, Any]:
    """`shard_group_choice` of the `--json` document (`--shard-group-size auto`)."""
    fields = ("k", "meets_targets", "reason", "bucket_size", "largest_bucket", "bucket_limit",
              "padding_fraction", "padding_limit", "ns_imbalance", "tried")  # fmt: skip
    out = {f: list(v) if isinstance(v := getattr(choice, f), tuple) else v for f in fields}
    return {**out, "strategy": choice.plan.strategy}


def size(n: int) -> str:
    """`n` bytes in binary units (`1.50 GiB`)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.2f} TiB"


def costs_lines(costs: Costs) -> list[str]:
    """The table's lines on memory and traffic ([Note: plan costs])."""
    mode, k, worst = costs.mode, costs.plan.shard_group_size, costs.worst_rank
    mine = costs.persistent[worst]
    sharded = "fully sharded" if fully_sharded(costs.plan, mode) else "ZeRO-1/2"
    flags = (("grad reduce", mode.overlap_grad_reduce), ("param gather", mode.overlap_param_gather))
    overlap = [what for what, on in flags if on]
    counts = ", ".join(f"{n} {op}" for op, n in costs.counts().items()) or "none"
    return [
        f"mode: {sharded}, params {mode.param_dtype}, grads reduced in "
        f"{mode.grad_reduce_dtype}, overlapped: {' and '.join(overlap) or 'nothing'}",
        f"per rank (shard rank {worst} of {k}, the most): params {size(mine['params'])}, grads "
        f"{size(mine['grads'])}, masters {size(mine['masters'])}, optimizer state "
        f"{size(mine['optimizer_state'])}, master grads {size(mine['master_grads'])}; total "
        f"{size(mine['total'])} (least {size(min(p['total'] for p in costs.persistent))}); "
        f"peak transient {size(costs.peak_transient)} (largest bucket "
        f"{size(costs.transient_unit)})",
        f"per step: {len(costs.collectives)} collectives ({counts}), {size(costs.bytes_sent)} "
        "sent per rank (ring model)",
    ]


def plan_table(plan: Plan, seconds: float, source: str, costs: Costs | None = None) -> str:
    """A readable summary (with `costs`, memory and traffic too) and one line per bucket of
    every buffer."""
    k, dp = plan.shard_group_size, plan.dp_size
    n_params = sum(len(b.placements) for b in plan.buffers)
    used = sum(b.used for b in plan.buffers)
    ns = plan.rank_costs()
    lines = [
        f"{source}: {n_params:,} params, {used:,} elements; dp {dp} = {dp // k} shard group(s) "
        f"of {k} ranks; strategy {plan.strategy}; buckets of >= {plan.bucket_size:,} elements; "
        f"planned in {seconds:.3f} s",
        f"padding {plan.padding_fraction:.3%} ({plan.numel - used:,} of {plan.numel:,} "
        f"elements); Newton-Schulz cost per rank min/mean/max {min(ns):.3g} / "
        f"{sum(ns) / k:.3g} / {max(ns):.3g}, imbalance {plan.ns_cost_imbalance:.3f}",
        *(costs_lines(costs) if costs is not None else []),
    ]
    header = (
        f"  {'bucket':>6} {'start':>17} {'end':>17} {'shards':>15} {'params':>7} "
        f"{'padding':>8}  {'collectives':<26} largest param"
    )
    for index, buffer in enumerate(plan.buffers):
        lines += [
            "",
            f"buffer {index} ({buffer.kind}, {buffer.sharding}): {buffer.numel:,} elements in "
            f"{len(buffer.buckets)} bucket(s)",
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
        for b, (count, bucket_used, widest) in zip(buffer.buckets, members, strict=True):
            shape = "x".join(map(str, widest.shape)) or "scalar"
            shards = f"{len(b.owner_starts)} owners" if b.owners else f"{b.shard_numel:,}"
            lines.append(
                f"  {b.index:>6} {b.start:>17,} {b.end:>17,} {shards:>15} {count:>7} "
                f"{1 - bucket_used / b.numel:>8.2%}  {collectives_of(b):<26} {widest.name} "
                f"({shape})"
            )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `wholeshard plan`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--shapes",
        metavar="FILE.json",
        help='{"params": [{"name", "shape", "matrix", optional "tied"}, ...]}, registration order',
    )
    source.add_argument("--preset", choices=sorted(PRESETS), help="a published model's shapes")
    parser.add_argument(
        "--dp", type=positive_int(MAX_DP), required=True, metavar="N", help="data-parallel ranks"
    )
    parser.add_argument(
        "--bucket-size",
        type=positive_int(),
        metavar="N",
        help="elements per bucket, at least (default: what DataParallel takes, "
        "default_bucket_size: about 1/8 of the params, at least 65,536, at most "
        "max(40M, 1M x dp))",
    )
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=DEFAULT_STRATEGY,
        help=f"how Muon matrices are dealt to ranks (default {DEFAULT_STRATEGY})",
    )
    parser.add_argument(
        "--shard-group-size",
        type=_group_size,
        metavar="K",
        help="shard params within groups of K ranks, replicated across the dp/K groups; "
        "K divides N (default N, as DataParallel's); 'auto': the largest K whose plan bounds "
        "buckets, padding and Newton-Schulz imbalance (says why)",
    )
    parser.add_argument(
        "--reshard-after-forward",
        action="store_true",
        help="fully sharded: between steps each rank keeps only its shards (the costs' mode)",
    )
    for flag, what in (("--param-dtype", "the params in the buffers"),
                       ("--grad-reduce-dtype", "gradients accumulated and reduced")):  # fmt: skip
        parser.add_argument(
            flag, choices=DTYPES, default="float32", help=f"dtype of {what} (default float32)"
        )
    parser.add_argument(
        "--overlap-grad-reduce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reduce buckets during backward, as DataParallel does by default (the fully "
        "sharded peak; default on)",
    )
    parser.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="gather buckets ahead of forward (the fully sharded peak)",
    )
    parser.add_argument(
        "--fabric",
        choices=sorted(FABRICS),
        help="project the step's communication and optimizer time on this fabric (GPUs per node, "
        "intra- and inter-node links: docs/planning.md)",
    )
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="with --fabric")
    parser.add_argument(
        "--tp",
        type=positive_int(),
        default=1,
        help="tensor-parallel ranks: plan each rank's slices (Megatron's split, by name) and "
        "report Muon's Newton-Schulz traffic per step in each tp mode (docs/parallelism.md)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument(
        "--png", metavar="FILE", help="draw each buffer's shards, coloured by owner, to FILE"
    )


def _group_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive_int()(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= 1 or 'auto', got {text!r}"
        ) from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `wholeshard plan` on the `wholeshard` subcommand parsers."""
    parser = subparsers.add_parser(
        "plan",
        help="plan the buffers of a model given by shapes, and show the plan",
        description="Plan whole-tensor (Muon) and element-wise (AdamW) buffers for a model "
        "given by a shapes file or a preset, without building it, and report padding, "
        "Newton-Schulz cost balance, every param's placement, and what the plan costs each "
        "rank in the mode the flags name: memory by kind and one step's collectives.",
    )
    add_arguments(parser)
    parser.set_defaults(run=main)
    return parser


def main(args: argparse.Namespace) -> int:
    """Run `wholeshard plan` with parsed `args`; return the exit code."""
    try:
        if args.shapes is not None:
            specs, source = load_shapes(args.shapes), args.shapes
        else:
            specs, source = PRESETS[args.preset](), args.preset
        traffic = {m: ns_traffic(specs, args.tp, m) for m in TP_MODES} if args.tp > 1 else None
        specs = local_specs(specs, args.tp)  # [Note: tensor-parallel shapes]
        start = time.perf_counter()
        plan, choice = plan_and_choice(
            specs,
            args.dp,
            bucket_size=args.bucket_size,
            strategy=args.strategy,
            shard_group_size=args.shard_group_size,
        )
        seconds = time.perf_counter() - start
        mode = Mode(
            reshard_after_forward=args.reshard_after_forward,
            param_dtype=args.param_dtype,
            grad_reduce_dtype=args.grad_reduce_dtype,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
        )
        costs = plan_costs(plan, specs, mode)
        projected = None if args.fabric is None else project(costs, args.fabric, args.gpu)
    except ValueError as e:  # ShapesError, or inputs no plan can serve
        print(f"wholeshard plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = plan_json(plan, specs, seconds, costs)
        if choice is not None:
            doc["shard_group_choice"] = choice_json(choice)
        if projected is not None:
            doc["projection"] = projected.as_dict()
        if traffic is not None:
            doc["tensor_parallel"] = {"tp": args.tp} | {f"{m}_bytes": b for m, b in traffic.items()}
        sys.stdout.write(json.dumps(doc, allow_nan=False) + "\n")
    else:
        if choice is not None:
            print(f"plan (auto): {choice.reason}\n")
        print(plan_table(plan, seconds, source, costs))
        if projected is not None:
            print(projected.describe())
        if traffic is not None:
            sent = ", ".join(f"{m} {size(b)}" for m, b in traffic.items())
            print(
                f"\ntp {args.tp} (each rank's slices planned): Muon's Newton-Schulz sends {sent} "
                f"per rank per step, beyond the data-parallel collectives"
            )
    if args.png is not None:
        try:
            from .plan_picture import draw_png

            draw_png(plan, args.png)
        except ImportError:
            print(
                "wholeshard plan: error: --png needs matplotlib (pip install matplotlib)",
                file=sys.stderr,
            )
            return 2
        except OSError as e:
            print(f"wholeshard plan: error: cannot write {args.png!r}: {e}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"\nwrote {args.png}")
    return 0
