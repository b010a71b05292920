"""`wholeshard train`: flags, checks made before any worker starts, and the launch.

Every `TrainConfig` field is a flag, made from the field (`flags.add_flags`): the sections'
fields, and the `parallel` section's from `DataParallelConfig` itself; only the launch and
output options that are not part of the job (`--nproc`, `--overwrite`, `--json`), the job file
(`--config`, `--print-config`: `wholeshard.train.jobfile`) and the shorthand `--overlap` are
written here. Precedence: the fields' defaults, then the job file, then the flags given (a
flag's default is marked `_Default`, so that a flag left out does not override the file).
Without torchrun it spawns `--nproc` CPU workers (gloo over 127.0.0.1) with
`wholeshard.distributed.launch`; under torchrun every launched process runs `train()` itself.
Both paths end in the same `wholeshard.train.trainer.train(config)`.

Ctrl-C: the first asks every rank to stop after the step in progress, once the checkpoint being
written in the background is complete; a second stops at once, abandoning it
(`interrupt.stops_at_a_step`). Without torchrun, the terminal's Ctrl-C reaches this process (the
workers ignore SIGINT), which asks its workers and, at a second, stops them. Under torchrun the
agent forwards its SIGINT to every worker, which asks itself, and sends SIGTERM (which ends a
worker at once) at a second, or SIGKILL after its `--shutdown-timeout` (30 s by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engine.config import ConfigError
from ..train import jobfile
from ..train.config import PARALLEL_SET_BY_THE_JOB, SECTIONS, TrainConfig
from . import MAX_NPROC, interrupt, positive_int
from .flags import add_flags, flag_name

_TITLES = {
    "": "job",
    "model": "model",
    "data": "data",
    "optim": "optimization",
    "parallel": "data parallelism (DataParallelConfig; muon)",
    "checkpoint": "checkpoints (muon)",
    "reliability": "reliability",
    "output": "output",
}
STOPPING = (
    "wholeshard train: stopping after the step in progress, once the checkpoint being written "
    "(if any) is complete; Ctrl-C again to stop at once"
)
"""What the first Ctrl-C prints."""
_METAVARS = {
    "name": "tiny|small|micro|hf:DIR|hf-config:FILE",
    "path": "PATH",
    "tokenizer": "DIR",
    "cache_dir": "DIR",
    "trace": "FILE",
    "resume": "PATH|latest|auto",
    "out": "DIR",
    "collective_timeout": "SECONDS",
}


class _Default:
    """The default of a config flag, marked: a flag not given takes the job file's value."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:  # (`--help`'s "default: ...")
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except None and switches (their help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default.value if isinstance(action.default, _Default) else action.default
        if default is None or isinstance(default, bool):
            return action.help
        return super()._get_help_string(action)


class _Overlap(argparse.Action):
    """`--overlap`: both `--overlap-grad-reduce` and `--overlap-param-gather`."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, "parallel.overlap_grad_reduce", True)
        setattr(namespace, "parallel.overlap_param_gather", True)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `train` subcommand."""
    p = subparsers.add_parser(
        "train",
        help="train a small GPT with layer-wise Muon (or AdamW) across processes",
        description="Train a byte-level GPT on the Python standard library's sources (or "
        "--data) with wholeshard DataParallel + layer-wise Muon, or torch DDP + AdamW.",
        formatter_class=_HelpFormatter,
    )
    groups = {name: p.add_argument_group(title) for name, title in _TITLES.items()}
    groups[""].add_argument(
        "--nproc",
        type=positive_int(MAX_NPROC),
        default=2,
        help=f"worker processes, at most {MAX_NPROC} (ignored under torchrun, which sets the "
        f"world)",
    )
    groups[""].add_argument(
        "--config",
        metavar="FILE",
        help="a TOML job file whose tables are the sections below ([data], [parallel], ...) and "
        "keys their fields (docs/train.md#job-files); flags given override it",
    )
    groups[""].add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (defaults, --config, flags) as a job file and exit",
    )
    dests = add_flags(groups[""], TrainConfig, skip=frozenset(SECTIONS), metavars=_METAVARS)
    for name, cls in SECTIONS.items():
        if name == "parallel":
            groups[name].add_argument(
                "--overlap",
                nargs=0,
                action=_Overlap,
                help="--overlap-grad-reduce and --overlap-param-gather",
            )
        skip = PARALLEL_SET_BY_THE_JOB if name == "parallel" else frozenset()
        dests += add_flags(groups[name], cls, dest=name + ".", skip=skip, metavars=_METAVARS)
    p.set_defaults(**{dest: _Default(p.get_default(dest)) for _, dest in dests})
    output = groups["output"]
    output.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a run already in --out: its metrics, summary, plot and checkpoints are "
        "deleted at the start (not with --resume)",
    )
    output.add_argument(
        "--json",
        action="store_true",
        help="print the summary as one JSON line on stdout at the end",
    )
    p.set_defaults(run=run, parser=p)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the parsed flags and the `--config` job file describe (the flags given
    win); an invalid value exits 2 naming its flag, or the file and its key. Sets
    `args.from_file`, the key paths whose values came from the file."""
    path = getattr(args, "config", None)
    from_file = {}
    if path is not None:
        try:
            from_file = jobfile.load(path)
        except jobfile.JobFileError as e:
            args.parser.error(f"argument --config: {e}")
    values = {
        k: from_file.get(k, v.value) if isinstance(v, _Default) else v
        for k, v in vars(args).items()
    }
    given = {k for k, v in vars(args).items() if not isinstance(v, _Default)}
    args.from_file = set(from_file) - given
    try:
        return jobfile.make_config({**from_file, **values})
    except ConfigError as e:
        args.parser.error(f"{_source(args, e.field)}: {e}")


def _source(args: argparse.Namespace, path: str) -> str:
    """Where the value of field `path` (`section.field`) came from, as an error names it:
    `argument --config: job.toml: data.batch_size`, or `argument --batch-size`."""
    if path in getattr(args, "from_file", ()):
        return f"argument --config: {args.config}: {path}"
    section, _, name = path.rpartition(".")
    cls = SECTIONS[section] if section else TrainConfig
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f"argument {flag_name(field)}"


def _check(args: argparse.Namespace, cfg: TrainConfig, world: int) -> None:
    """Everything that can be checked before any worker starts; exits 2 like argparse."""
    from ..train import extras, outputs

    parser: argparse.ArgumentParser = args.parser
    try:
        cfg.data_parallel_size(world)
    except ConfigError as e:
        parser.error(f"{_source(args, e.field)}: {e}")
    _check_model(parser, cfg, _source(args, "model.name"))
    if cfg.data.path is not None:
        _check_data(parser, cfg, _source(args, "data.path"))
    _check_start(parser, cfg, args.overwrite)
    try:
        outputs.check_out_dir(cfg.output.out, args.overwrite or cfg.checkpoint.resume is not None)
    except ValueError as e:
        parser.error(f"argument --out: {e}")
    lost = extras.missing()
    if lost:
        parser.exit(
            1,
            f"wholeshard train: missing {', '.join(lost)}; "
            "install the train extra: pip install 'wholeshard[train]'\n",
        )


def _check_data(parser: argparse.ArgumentParser, cfg: TrainConfig, where: str) -> None:
    """`--data` exists; record files have the text field; bytes are more than `--seq-len` in
    both splits. (Token counts are checked by the job, after tokenizing.)"""
    from ..train import data, tokens
    from ..train.model import tokenizer_dir

    path = cfg.data.path
    if not os.path.exists(path):
        parser.error(f"{where}: no such file or directory: {path}")
    try:
        files, reader, _ = tokens.find_inputs(path)
        if reader is not None or tokenizer_dir(cfg) is not None:
            tokens.check_inputs(files, reader, cfg.data.text_field)
            return
        corpus = data.load_corpus(path, val_fraction=cfg.data.val_fraction)
    except (OSError, ValueError) as e:
        parser.error(f"{where}: {e}")
    except ImportError as e:  # the hf extra, for record files
        parser.exit(1, f"wholeshard train: {e}\n")
    for part in ("train", "val"):
        n = len(getattr(corpus, part))
        if n <= cfg.data.seq_len:
            parser.error(
                f"{where}: {path} gives {n} bytes of {part} text ({cfg.data.val_fraction:g} of "
                f"the text is validation); need more than --seq-len={cfg.data.seq_len}"
            )


def _check_model(parser: argparse.ArgumentParser, cfg: TrainConfig, where: str) -> None:
    """A transformers model's directory or config file exists, and the `hf` extra is here."""
    from ..train import extras
    from ..train.sections import HF_CONFIG, HF_DIR

    name = cfg.model.name
    if not cfg.is_hf:
        return
    if name.startswith(HF_DIR) and not os.path.isdir(name.removeprefix(HF_DIR)):
        parser.error(f"{where}: {name.removeprefix(HF_DIR)} is not a directory")
    if name.startswith(HF_CONFIG) and not os.path.isfile(name.removeprefix(HF_CONFIG)):
        parser.error(f"{where}: no such file: {name.removeprefix(HF_CONFIG)}")
    tokenizer = cfg.data.tokenizer
    if tokenizer is not None and not os.path.isdir(tokenizer):
        parser.error(f"argument --tokenizer: {tokenizer} is not a directory")
    try:
        for package in extras.HF_EXTRA:
            extras.require(package, extra="hf")
    except extras.MissingExtra as e:
        parser.exit(1, f"{e}\n")


def _check_start(parser: argparse.ArgumentParser, cfg: TrainConfig, overwrite: bool) -> None:
    """The checkpoint `--resume` names, and that the run's saves replace none in
    `<out>/checkpoints` (`wholeshard.train.resume`); sets `--out` from `--resume PATH`."""
    resume = cfg.checkpoint.resume
    if overwrite and resume is not None:
        parser.error(
            "argument --overwrite: not allowed with --resume: --overwrite starts the run over, "
            "deleting its outputs and checkpoints; --resume continues it"
        )
    if resume is None and not Path(cfg.checkpoint_dir).is_dir():
        return  # (without importing torch.distributed.checkpoint)
    from ..checkpoint.directory import CheckpointError
    from ..train.resume import check_start, find_checkpoint

    try:
        ckpt = find_checkpoint(cfg)
    except CheckpointError as e:
        parser.error(f"argument --resume: {e}")
    if cfg.output.out is None:  # --resume PATH: the run it belongs to, <out>/checkpoints/step-N
        cfg.output.out = str(ckpt.parent.parent)
    if not overwrite:  # (--overwrite removes them: `run`)
        try:
            check_start(cfg, ckpt)
        except CheckpointError as e:
            parser.error(f"argument {'--out' if ckpt is None else '--resume'}: {e}")


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

    Every process runs `worker(config)`, by default `trainer.train`; another worker (e.g. one that
    installs hooks) must be picklable to reach spawned processes.
    """
    from ..train import outputs
    from ..train.env import torchrun_env
    from ..train.trainer import train

    worker = worker or train
    cfg = config_from_args(args)
    if getattr(args, "print_config", False):
        try:
            print(jobfile.dumps(cfg), end="")
        except ConfigError as e:
            args.parser.error(f"argument --print-config: {e}")
        return 0
    under_torchrun = torchrun_env()
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc
    if cfg.output.out is None and cfg.checkpoint.resume is None:
        cfg.output.out = outputs.default_out_dir()
    _check(args, cfg, world)
    if args.overwrite and (not under_torchrun or os.environ["RANK"] == "0"):
        from ..train.resume import remove_checkpoints

        remove_checkpoints(Path(cfg.checkpoint_dir))  # before any rank's first collective
    if under_torchrun:
        from ..distributed.collectives import CollectiveError

        rank0 = os.environ["RANK"] == "0"
        try:
            with interrupt.stops_at_a_step(STOPPING if rank0 else None, exit_as="wholeshard train"):
                summary = worker(cfg)
        except CollectiveError as e:  # torchrun tears the job down when this rank exits
            print(f"wholeshard train: {e}", file=sys.stderr, flush=True)
            return 1
        except KeyboardInterrupt:  # (stopped at a step, the save in flight complete)
            print(interrupt.line("wholeshard train"), file=sys.stderr, flush=True)
            return interrupt.INTERRUPTED
        if rank0:
            _print_summary(summary, args.json)
        return 0

    from ..distributed.launch import WorkerFailed
    from ..train.restarts import train_local

    try:
        with interrupt.stops_at_a_step(STOPPING):  # the launcher asks its workers, or stops them
            summary = train_local(cfg, args.nproc, worker)
    except WorkerFailed as e:
        print(f"wholeshard train: worker failed; all workers stopped.\n{e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("wholeshard train: interrupted; all workers stopped.", file=sys.stderr)
        return interrupt.INTERRUPTED
    _print_summary(summary, args.json)
    return 0
