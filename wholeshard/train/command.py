"""`wholeshard train`: flags, checks made before any worker starts, and the launch.

Every TrainConfig field is a flag, made from the field (`_add_config_flags`); only the launch
and output options that are not part of the job (`--nproc`, `--overwrite`, `--json`) are written
here. Without torchrun it spawns `--nproc` CPU workers (gloo over 127.0.0.1) with
`wholeshard.launch`; under torchrun every launched process runs `train()` itself. Both paths
end in the same `wholeshard.train.loop.train(config)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wholeshard.cli import MAX_NPROC, positive_int
from wholeshard.train import config as C
from wholeshard.train import extras, report
from wholeshard.train.config import ConfigError, TrainConfig


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except None and switches (their help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


_GROUPS = {
    "launch": ("threads",),
    "model and data": ("model", "pos", "tie", "data", "seq_len", "batch_size"),
    "optimization": (
        "optimizer", "steps", "lr", "warmup", "schedule", "min_lr_ratio", "weight_decay",
        "clip_grad", "on_nonfinite", "param_dtype", "bucket_size", "fp8", "seed",
    ),
    "data parallelism (muon)": (
        "overlap", "scheme", "param_sync", "reshard_after_forward", "separate_all_gather_group",
        "trace",
    ),
    "checkpoints (muon)": ("checkpoint_every", "keep_last", "resume"),
    "reliability": ("collective_timeout", "max_restarts"),
    "output": ("out", "eval_every", "eval_batches", "log_every", "progress"),
}  # fmt: skip
"""Where each TrainConfig field's flag is listed in `--help`; fields not named here go to
"more options"."""

_METAVARS = {
    "data": "PATH",
    "trace": "FILE",
    "resume": "PATH|latest",
    "out": "DIR",
    "collective_timeout": "SECONDS",
}


def flag_name(field: str) -> str:
    """The command-line spelling of a TrainConfig field: `batch_size` -> `--batch-size`."""
    return "--" + field.replace("_", "-")


def _add_config_flags(parser: argparse.ArgumentParser, groups: dict) -> None:
    """One flag per TrainConfig field: its type, default, choices (`config.CHOICES`) and help
    (the field's docstring). A switch off by default is `--x`; one on by default, or None (the
    field decides), is `--x/--no-x`."""
    hints = typing.get_type_hints(TrainConfig)
    docs = C.field_docs()
    listed = {name: title for title, names in _GROUPS.items() for name in names}
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name in list(listed) + [name for name in fields if name not in listed]:
        title = listed.get(name, "more options")
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        kind = _flag_type(name, hints[name])
        default = fields[name].default
        kwargs = dict(default=default, help=docs.get(name, "").replace("%", "%%"))
        if kind is bool and default is False:
            kwargs.update(action="store_true")
        elif kind is bool:
            kwargs.update(action=argparse.BooleanOptionalAction)
        else:
            kwargs.update(type=kind, choices=C.CHOICES.get(name), metavar=_METAVARS.get(name))
        groups[title].add_argument(flag_name(name), **kwargs)


def _flag_type(name: str, hint: Any) -> type:
    kinds = [k for k in typing.get_args(hint) or (hint,) if k is not type(None)]
    if len(kinds) != 1 or kinds[0] not in (bool, int, float, str):
        raise TypeError(f"TrainConfig.{name}: no command-line flag for type {hint}")
    return kinds[0]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `train` subcommand."""
    p = subparsers.add_parser(
        "train",
        help="train a small GPT with layer-wise Muon (or AdamW) across processes",
        description="Train a byte-level GPT on the Python standard library's sources (or "
        "--data) with wholeshard DataParallel + layer-wise Muon, or torch DDP + AdamW.",
        formatter_class=_HelpFormatter,
    )
    launch = p.add_argument_group("launch")
    launch.add_argument(
        "--nproc",
        type=positive_int(MAX_NPROC),
        default=2,
        help=f"worker processes, at most {MAX_NPROC} (ignored under torchrun, which sets the "
        f"world)",
    )
    groups = {"launch": launch}
    _add_config_flags(p, groups)
    p.add_argument(
        "--layout", dest="scheme", choices=C.SCHEMES, default=argparse.SUPPRESS,
        action=_DeprecatedSpelling, help=argparse.SUPPRESS,
    )  # fmt: skip
    output = groups["output"]
    output.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    output.add_argument(
        "--json",
        action="store_true",
        help="print the summary as one JSON line on stdout at the end",
    )
    p.set_defaults(run=run, parser=p)
    return p


class _DeprecatedSpelling(argparse.Action):
    """An old spelling of a flag: sets the flag's field and says so on stderr."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(
            f"wholeshard train: {option_string} is deprecated, use {flag_name(self.dest)}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the parsed flags describe; an invalid value exits 2 naming its flag."""
    try:
        return TrainConfig(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
        )
    except ConfigError as e:
        args.parser.error(f"argument {flag_name(e.field)}: {e}")


def _check(args: argparse.Namespace, cfg: TrainConfig, world: int) -> None:
    """Everything that can be checked before any worker starts; exits 2 like argparse."""
    parser: argparse.ArgumentParser = args.parser
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
    from wholeshard.checkpoint_dir import CheckpointError, resolve_checkpoint, steps_after

    if cfg.resume == "latest" and cfg.out is None:
        parser.error("argument --resume: latest needs --out DIR of the run to continue")
    try:
        ckpt = resolve_checkpoint(cfg.resume_path)
    except CheckpointError as e:
        parser.error(f"argument --resume: {e}")
    if cfg.out is None:  # the run the checkpoint belongs to: <out>/checkpoints/step-N
        cfg.out = str(ckpt.parent.parent)
    later = [p.name for p in steps_after(ckpt)]
    if later and ckpt.parent.resolve() == Path(cfg.checkpoint_dir).resolve():
        parser.error(
            f"argument --resume: {', '.join(later)} come after {ckpt.name} in "
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


def run(args: argparse.Namespace, worker: Callable[[TrainConfig], dict] | None = None) -> int:
    """Check the flags, then train locally (spawned workers) or as one torchrun process.

    Every process runs `worker(config)`, by default `loop.train`; another worker (e.g. one that
    installs hooks) must be picklable to reach spawned processes.
    """
    from wholeshard.train.loop import torchrun_env, train

    worker = worker or train
    cfg = config_from_args(args)
    under_torchrun = torchrun_env()
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc
    if cfg.out is None and cfg.resume is None:
        cfg.out = report.default_out_dir()
    _check(args, cfg, world)
    if under_torchrun:
        from wholeshard._collectives import CollectiveError

        try:
            summary = worker(cfg)
        except CollectiveError as e:  # torchrun tears the job down when this rank exits
            print(f"wholeshard train: {e}", file=sys.stderr, flush=True)
            return 1
        if int(os.environ["RANK"]) == 0:
            _print_summary(summary, args.json)
        return 0

    from wholeshard.launch import WorkerFailed
    from wholeshard.train.restarts import train_local

    try:
        summary = train_local(cfg, args.nproc, worker)
    except WorkerFailed as e:
        print(f"wholeshard train: worker failed; all workers stopped.\n{e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("wholeshard train: interrupted; all workers stopped.", file=sys.stderr)
        return 130
    _print_summary(summary, args.json)
    return 0
