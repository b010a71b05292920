"""`wholeshard train`: flags, checks made before any worker starts, and the launch.

Without torchrun it spawns `--nproc` CPU workers (gloo over 127.0.0.1) with
`wholeshard.launch`; under torchrun every launched process runs `train()` itself. Both paths
end in the same `wholeshard.train.loop.train(config)`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from wholeshard.train import config as C
from wholeshard.train import extras, report
from wholeshard.train.config import TrainConfig


def _number(kind, low, strict: bool, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


_pos_int = _number(int, 1, False, "an integer >= 1")
_nonneg_int = _number(int, 0, False, "an integer >= 0")
_pos_float = _number(float, 0.0, True, "a number > 0")
_nonneg_float = _number(float, 0.0, False, "a number >= 0")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except None and switches (their help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `train` subcommand."""
    d = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="train a small GPT with layer-wise Muon (or AdamW) across processes",
        description="Train a byte-level GPT on the Python standard library's sources (or "
        "--data) with wholeshard DataParallel + layer-wise Muon, or torch DDP + AdamW.",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("launch")
    g.add_argument(
        "--nproc",
        type=_pos_int,
        default=2,
        help="worker processes (ignored under torchrun, which sets the world)",
    )
    g.add_argument(
        "--threads",
        type=_pos_int,
        default=None,
        help="CPU threads per worker (default: cores / local workers)",
    )
    g = p.add_argument_group("model and data")
    g.add_argument("--model", choices=C.MODELS, default=d.model, help="model preset")
    g.add_argument(
        "--pos", choices=C.POSITIONS, default=None, help="position encoding (default: the preset's)"
    )
    g.add_argument(
        "--tie",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tie the output head to the embedding (default: the preset's)",
    )
    g.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="text file or directory (default: the Python stdlib's .py sources)",
    )
    g.add_argument("--seq-len", type=_pos_int, default=d.seq_len, help="bytes per sequence")
    g.add_argument(
        "--batch-size",
        type=_pos_int,
        default=d.batch_size,
        help="global batch in sequences (split across ranks)",
    )
    g = p.add_argument_group("optimization")
    g.add_argument(
        "--optimizer",
        choices=C.OPTIMIZERS,
        default=d.optimizer,
        help="muon: DataParallel + LayerwiseOptimizer; adamw: torch DDP + AdamW",
    )
    g.add_argument("--steps", type=_pos_int, default=d.steps, help="optimizer steps")
    g.add_argument(
        "--lr", type=_pos_float, default=None, help=f"peak learning rate (default: {C.DEFAULT_LR})"
    )
    g.add_argument(
        "--warmup",
        type=_nonneg_int,
        default=None,
        help="linear warm-up steps (default: 5%% of --steps)",
    )
    g.add_argument(
        "--schedule", choices=C.SCHEDULES, default=d.schedule, help="decay after warm-up"
    )
    g.add_argument(
        "--min-lr-ratio",
        type=_nonneg_float,
        default=d.min_lr_ratio,
        help="final lr as a fraction of the peak",
    )
    g.add_argument(
        "--weight-decay", type=_nonneg_float, default=d.weight_decay, help="decoupled weight decay"
    )
    g.add_argument(
        "--clip-grad",
        type=_nonneg_float,
        default=d.clip_grad,
        help="max global grad norm (0: no clipping)",
    )
    g.add_argument(
        "--param-dtype",
        choices=C.PARAM_DTYPES,
        default=d.param_dtype,
        help="param dtype in forward/backward (optimizers keep fp32 masters)",
    )
    g.add_argument(
        "--bucket-size",
        type=_pos_int,
        default=None,
        help="gradient bucket size in elements (default: the library's)",
    )
    g.add_argument(
        "--fp8",
        choices=C.FP8_RECIPES,
        default=None,
        help="FP8 compute for the hidden linear layers (default: off)",
    )
    g.add_argument("--seed", type=_nonneg_int, default=d.seed, help="model init and batch order")
    g = p.add_argument_group("data parallelism (muon)")
    g.add_argument(
        "--overlap",
        action="store_true",
        help="reduce-scatter during backward, all-gather during the next forward",
    )
    g.add_argument("--layout", choices=C.LAYOUTS, default=d.layout, help="ownership layout")
    g.add_argument(
        "--param-sync", choices=C.PARAM_SYNCS, default=d.param_sync, help="param sync collective"
    )
    g.add_argument(
        "--reshard-after-forward",
        action="store_true",
        help="fully sharded: keep only owned params between steps, gather them per module",
    )
    g.add_argument(
        "--separate-all-gather-group",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="param all-gathers on their own process group (default: on iff fully sharded)",
    )
    g.add_argument(
        "--trace", default=None, metavar="FILE", help="write a Chrome trace of a few steps"
    )
    g = p.add_argument_group("checkpoints (muon)")
    g.add_argument(
        "--checkpoint-every",
        type=_nonneg_int,
        default=d.checkpoint_every,
        help="save to <out>/checkpoints every N steps (0: never)",
    )
    g.add_argument("--keep-last", type=_pos_int, default=d.keep_last, help="checkpoints to keep")
    g.add_argument(
        "--resume",
        default=None,
        metavar="PATH|latest",
        help="continue from a checkpoint (latest: <out>/checkpoints); needs --out of the run",
    )
    g = p.add_argument_group("reliability")
    g.add_argument(
        "--collective-timeout",
        type=_pos_float,
        default=d.collective_timeout,
        metavar="SECONDS",
        help="fail a collective (a peer likely died or stalled) after this long",
    )
    g.add_argument(
        "--max-restarts",
        type=_nonneg_int,
        default=d.max_restarts,
        help="local launcher: relaunch from the latest checkpoint after a worker failure, "
        "at most N times (needs --checkpoint-every)",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--out", default=None, metavar="DIR", help="output directory (default: runs/<timestamp>)"
    )
    g.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    g.add_argument(
        "--eval-every",
        type=_pos_int,
        default=d.eval_every,
        help="steps between validation evaluations",
    )
    g.add_argument(
        "--eval-batches",
        type=_pos_int,
        default=d.eval_batches,
        help="validation batches per evaluation",
    )
    g.add_argument(
        "--log-every",
        type=_pos_int,
        default=d.log_every,
        help="steps between metrics.jsonl records",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument(
        "--json",
        action="store_true",
        help="print the summary as one JSON line on stdout at the end",
    )
    p.set_defaults(run=run, parser=p)
    return p


_FIELDS = [f for f in TrainConfig.__dataclass_fields__]


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the parsed flags describe (not yet validated)."""
    return TrainConfig(**{name: getattr(args, name) for name in _FIELDS})


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _check(args: argparse.Namespace, cfg: TrainConfig, world: int) -> None:
    """Everything that can be checked before any worker starts; exits 2 like argparse."""
    parser: argparse.ArgumentParser = args.parser
    try:
        cfg.validate()
    except ValueError as e:
        field = str(e).split()[0]
        parser.error(f"argument {_flag(field)}: {e}")
    if cfg.batch_size % world:
        parser.error(
            f"argument --batch-size: {cfg.batch_size} sequences do not split evenly across "
            f"{world} processes; use a multiple of {world}"
        )
    if cfg.data is not None:
        from wholeshard.train import data

        if not os.path.exists(cfg.data):
            parser.error(f"argument --data: no such file or directory: {cfg.data}")
        try:
            corpus = data.load_corpus(cfg.data)
        except (OSError, ValueError) as e:
            parser.error(f"argument --data: {e}")
        for part in ("train", "val"):
            n = len(getattr(corpus, part))
            if n <= cfg.seq_len:
                parser.error(
                    f"argument --data: {cfg.data} gives {n} bytes of {part} text (5% of the "
                    f"text is validation); need more than --seq-len={cfg.seq_len}"
                )
    if cfg.resume is not None:
        _check_resume(parser, cfg)
    try:
        report.check_out_dir(cfg.out, args.overwrite or cfg.resume is not None)
    except ValueError as e:
        parser.error(f"argument --out: {e}")
    lost = extras.missing()
    if lost:
        parser.exit(
            1,
            f"wholeshard train: missing {', '.join(lost)}; "
            "install the train extra: pip install 'wholeshard[train]'\n",
        )


def _check_resume(parser: argparse.ArgumentParser, cfg: TrainConfig) -> None:
    from wholeshard.checkpoint import CheckpointError, resolve_checkpoint

    if cfg.resume == "latest" and cfg.out is None:
        parser.error("argument --resume: latest needs --out DIR of the run to continue")
    try:
        ckpt = resolve_checkpoint(cfg.resume_path)
    except CheckpointError as e:
        parser.error(f"argument --resume: {e}")
    if cfg.out is None:  # the run the checkpoint belongs to: <out>/checkpoints/step-N
        cfg.out = str(ckpt.parent.parent)
    later = [
        p.name
        for p in ckpt.parent.glob("step-*")
        if p.name[5:].isdigit() and int(p.name[5:]) > int(ckpt.name[5:])
    ]
    if later and ckpt.parent.resolve() == Path(cfg.checkpoint_dir).resolve():
        parser.error(
            f"argument --resume: {', '.join(sorted(later))} come after {ckpt.name} in "
            f"{ckpt.parent}; resuming from {ckpt.name} would overwrite them. Move them away "
            f"or resume from latest"
        )


def _print_summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary), flush=True)
        return
    print(
        f"{summary['steps']} steps, {summary['world_size']} rank(s), {summary['optimizer']}: "
        f"val loss {summary['first_val_loss']:.3f} -> {summary['final_val_loss']:.3f} "
        f"in {summary['wall_s']:.1f} s; outputs in {summary['out']}",
        flush=True,
    )


def run(args: argparse.Namespace) -> int:
    """Check the flags, then train locally (spawned workers) or as one torchrun process."""
    from wholeshard.train.loop import torchrun_env, train

    cfg = config_from_args(args)
    under_torchrun = torchrun_env()
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc
    if cfg.out is None and cfg.resume is None:
        cfg.out = report.default_out_dir()
    _check(args, cfg, world)
    if under_torchrun:
        from wholeshard.collectives import CollectiveError

        try:
            summary = train(cfg)
        except CollectiveError as e:  # torchrun tears the job down when this rank exits
            print(f"wholeshard train: {e}", file=sys.stderr, flush=True)
            return 1
        if int(os.environ["RANK"]) == 0:
            _print_summary(summary, args.json)
        return 0

    from wholeshard.launch import WorkerFailed
    from wholeshard.train.restarts import train_local

    try:
        summary = train_local(cfg, args.nproc)
    except WorkerFailed as e:
        print(f"wholeshard train: worker failed; all workers stopped.\n{e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("wholeshard train: interrupted; all workers stopped.", file=sys.stderr)
        return 130
    _print_summary(summary, args.json)
    return 0
