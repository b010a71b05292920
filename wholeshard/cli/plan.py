"""`wholeshard plan`: plan the buffers of a model given by shapes alone (a shapes file,
`capacity.shapes`, a preset, or a transformers model directory, `capacity.model_shapes`), and
show what the plan costs each rank in the mode the flags name (`capacity.costs`; by default as
users train: bf16 params, grads reduced in fp32): persistent bytes by kind, the peak of
transient full buckets, one step's collectives and bytes sent; with `--fabric`, a projection of
the step's communication and optimizer time (`capacity.projection`) and, where its latency term
is a large share, a `--bucket-size` that shrinks it (`capacity.bucket_hint`); the chosen
strategy's step beside the runner-up among balanced, owners and exchange, and the group
structure (one level, or two of the fabric's GPUs per node: `--node-size`) projected faster
(`capacity.strategy_choice`, on `--fabric` or nvlink4-ndr400); then the plan itself
(`plan_text`, or `--json`). Exit codes: 0 planned, 2 bad input (argparse errors, an unreadable
or malformed shapes file or model, a model no torch process could hold, a model no plan can
serve)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..capacity.bucket_hint import bucket_size_hint
from ..capacity.choice import ShardGroupChoice, plan_and_choice
from ..capacity.costs import Costs, Mode, plan_costs
from ..capacity.model_shapes import HF_DIR, ModelError, model_specs
from ..capacity.presets import PRESETS
from ..capacity.projection import FABRICS, GPUS, project
from ..capacity.shapes import load_shapes
from ..capacity.strategy_choice import strategy_choice
from ..capacity.tp_traffic import TP_MODES, local_specs, ns_traffic
from ..planning import DEFAULT_STRATEGY, STRATEGIES, Bucket, ParamSpec, Plan
from ..planning.specs import matrices
from . import positive_int
from .plan_text import collectives_of, plan_table, size

__all__ = ["add_parser", "main", "plan_json"]

MAX_DP = 1 << 20
"""Largest `--dp`: beyond any cluster, and the plan keeps per-rank tables."""
DTYPES = ("float32", "bfloat16", "float16")
"""The choices of `--param-dtype` and `--grad-reduce-dtype`."""
DEFAULT_DTYPES = {"param_dtype": "bfloat16", "grad_reduce_dtype": "float32"}
"""The dtypes assumed where the flags name none: as users train (the train job's bf16 params,
grads reduced in fp32); `--json`'s `assumed_dtypes` lists those it assumed."""
MODE_FIELDS = ("reshard_after_forward", "param_dtype", "grad_reduce_dtype", "overlap_grad_reduce",
               "overlap_param_gather", "clip_grad_norm", "offload_state")  # fmt: skip
"""The `Mode` fields the JSON's `mode` echoes (with the plan's `shard_group_size`)."""
CHOICE_FABRIC = "nvlink4-ndr400"
"""The fabric the strategy comparison is projected on when `--fabric` names none."""


def costs_json(costs: Costs) -> dict[str, Any]:
    """`mode`, `per_rank` and `per_step` of the `--json` document ([Note: plan costs]):
    persistent bytes by kind of the shard-group rank holding the most and where they are
    (device, host), the peak of transient full buckets, and one step's collectives by op and
    bytes sent per rank."""
    mode, worst = costs.mode, costs.worst_rank
    return {
        "mode": {name: getattr(mode, name) for name in MODE_FIELDS}
        | {"shard_group_size": costs.plan.shard_group_size},
        "per_rank": {
            "shard_rank": worst,
            "persistent_bytes": costs.persistent[worst],
            "persistent_total_min": min(p["total"] for p in costs.persistent),
            "device_bytes": costs.device_bytes(worst),
            "host_bytes": costs.host_bytes(worst),
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
        elif len(p.owners) > 1:  # a stack in an exchange buffer
            entry["matrix_owners"] = list(p.owners)
        params.append(entry)
    return {
        "dp": plan.dp_size,
        "strategy": plan.strategy,
        "shard_group_size": plan.shard_group_size,
        "node_size": plan.node_size,
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `wholeshard plan`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--shapes",
        metavar="FILE.json",
        help='{"params": [{"name", "shape", "matrix", optional "tied"}, ...]}, registration order',
    )
    source.add_argument("--preset", choices=sorted(PRESETS), help="a published model's shapes")
    source.add_argument(
        "--model",
        type=_model,
        metavar="hf:DIR",
        help="a local transformers model directory: its causal LM built from config.json on the "
        "meta device (no weights read, nothing downloaded; needs transformers)",
    )
    parser.add_argument(
        "--dp", type=positive_int(MAX_DP), required=True, metavar="N", help="data-parallel ranks"
    )
    parser.add_argument(
        "--bucket-size",
        type=positive_int(),
        metavar="N",
        help="elements at which a bucket closes (an element-wise one also where a layer ends; "
        "default: what DataParallel takes, default_bucket_size: about 1/8 of the params, at "
        "least 65,536, at most max(40M, 1M x dp))",
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
        "--node-size",
        type=positive_int(),
        metavar="N",
        help="two-level groups: the ranks of a node (torchrun's --nproc-per-node); each bucket "
        "reduce-scatters within the node, then across nodes, where a shard group spans several "
        "(DataParallelConfig.node_size; default: one level)",
    )
    parser.add_argument(
        "--reshard-after-forward",
        action="store_true",
        help="fully sharded: between steps each rank keeps only its shards (the costs' mode)",
    )
    for field, what in (("param_dtype", "the params in the buffers, fp32 masters unless float32"),
                        ("grad_reduce_dtype", "gradients accumulated and reduced")):  # fmt: skip
        default = DEFAULT_DTYPES[field]
        parser.add_argument(
            f"--{field.replace('_', '-')}",
            choices=DTYPES,
            help=f"dtype of {what} (default {default}, as the train job)",
        )
    parser.add_argument(
        "--overlap-grad-reduce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reduce buckets during backward, as DataParallel does by default (the fully "
        "sharded peak; default on)",
    )
    parser.add_argument(
        "--offload-state",
        action="store_true",
        help="the optimizer keeps fp32 masters and state in host memory "
        "(LayerwiseOptimizer(offload_state=True)): the device/host split",
    )
    parser.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="gather buckets ahead of forward (the fully sharded peak)",
    )
    parser.add_argument(
        "--fabric",
        choices=sorted(FABRICS),
        help="project the step's communication (latency and bandwidth terms) and optimizer time "
        "on this fabric (GPUs and NICs per node, intra- and inter-node links: docs/planning.md)",
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


def _specs(args: argparse.Namespace) -> tuple[list[ParamSpec], str]:
    """The specs the source flag names, and its name for the table."""
    if args.shapes is not None:
        return load_shapes(args.shapes), args.shapes
    if args.model is not None:
        try:
            return model_specs(args.model), args.model
        except ModelError as e:  # names the model
            raise ValueError(f"--model {e}") from None
        except ValueError as e:  # routing: nothing for Muon (its table of routes left out)
            raise ValueError(f"--model {args.model}: {str(e).splitlines()[0]}") from None
    return PRESETS[args.preset](), args.preset


def _model(text: str) -> str:
    if not text.startswith(HF_DIR) or text == HF_DIR:
        raise argparse.ArgumentTypeError(
            f"expected hf:DIR, a transformers model directory, got {text!r}"
        )
    return text


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
        help="plan the buffers of a model given by shapes, and show what each rank holds",
        description="Plan whole-tensor (Muon) and element-wise (AdamW) buffers for a model "
        "given by a shapes file, a preset or a transformers model directory, without "
        "allocating it, and report what the plan costs each rank in the mode the flags name "
        "(memory by kind, one step's collectives and bytes sent, with --fabric a projected step "
        "time), then padding, Newton-Schulz cost balance and every bucket.",
    )
    add_arguments(parser)
    parser.set_defaults(run=main)
    return parser


def main(args: argparse.Namespace) -> int:
    """Run `wholeshard plan` with parsed `args`; return the exit code."""
    assumed = {f: d for f, d in DEFAULT_DTYPES.items() if getattr(args, f) is None}
    dtypes = {f: getattr(args, f) or d for f, d in DEFAULT_DTYPES.items()}
    try:
        specs, source = _specs(args)
        traffic = {m: ns_traffic(specs, args.tp, m) for m in TP_MODES} if args.tp > 1 else None
        specs = local_specs(specs, args.tp)  # [Note: tensor-parallel shapes]
        start = time.perf_counter()
        plan, choice = plan_and_choice(
            specs,
            args.dp,
            bucket_size=args.bucket_size,
            strategy=args.strategy,
            shard_group_size=args.shard_group_size,
            node_size=args.node_size,
        )
        seconds = time.perf_counter() - start
        mode = Mode(
            reshard_after_forward=args.reshard_after_forward,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            offload_state=args.offload_state,
            **dtypes,
        )
        costs = plan_costs(plan, specs, mode)
        projected = hint = None
        fabric = args.fabric or CHOICE_FABRIC
        strategies = strategy_choice(
            costs, specs, fabric, args.gpu, args.bucket_size, args.node_size
        )
        if args.fabric is not None:
            projected = project(costs, args.fabric, args.gpu)
            settings = {"strategy": args.strategy, "shard_group_size": args.shard_group_size,
                        "node_size": args.node_size}  # fmt: skip
            hint = bucket_size_hint(costs, projected, specs, **settings)
    except ValueError as e:  # ShapesError, ModelError, or inputs no plan can serve
        print(f"wholeshard plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = plan_json(plan, specs, seconds, costs) | {"assumed_dtypes": assumed}
        if choice is not None:
            doc["shard_group_choice"] = choice_json(choice)
        doc["strategy_choice"] = strategies.as_dict()
        if projected is not None:
            doc["projection"] = projected.as_dict()
            doc["projection"]["bucket_size_hint"] = None if hint is None else hint.as_dict()
        if traffic is not None:
            doc["tensor_parallel"] = {"tp": args.tp} | {f"{m}_bytes": b for m, b in traffic.items()}
        sys.stdout.write(json.dumps(doc, allow_nan=False) + "\n")
    else:
        tp_sent = None
        if traffic is not None:
            sent = ", ".join(f"{m} {size(b)}" for m, b in traffic.items())
            tp_sent = (
                f"tp {args.tp} (each rank's slices planned): Muon's Newton-Schulz sends {sent} "
                "per rank per step, beyond the data-parallel collectives"
            )
        flags = [f"--{f.replace('_', '-')} {d}" for f, d in assumed.items()]
        if args.tp > 1:
            source += f" (one tp rank's slices of {args.tp})"
        print(plan_table(plan, seconds, source, costs, choice=choice, projected=projected,
                         hint=hint, assumed=flags, tp_sent=tp_sent,
                         strategies=strategies))  # fmt: skip
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
