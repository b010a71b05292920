"""Test-only faults for `wholeshard train`: the train worker with a hook that makes one rank fail.

In process: `run_train(["train", *flags], fault)` runs `wholeshard train` with every worker
running `faulty_train`. As a program (spawned workers find this module on `sys.path`):

    python tests/train/train_faults.py RANK:STEP:KIND[:WHEN] train FLAGS...

`KIND`: `raise` (RuntimeError), `exit` (`os._exit(3)`), `kill` (SIGKILL), `node` (SIGKILL to
the torchrun agent that started this worker, then to the worker: a lost node), `wait` (in a
world of one rank, sleep until stopped, for at most `WAIT_S`: the run waits there for a node to
join; in a larger world, nothing) or `hold` (with `mid_save`: the save's write on this rank
writes the file `holding` in the directory `$WHOLESHARD_TEST_HOLD` and waits there until the
test writes `release`, while this rank's training waits after the step until it is asked to
stop, `stop.requested()`: a Ctrl-C lands while that background save is in flight, before the
next save; each wait lasts at most `WAIT_S`). `WHEN`: `after_step` (default: once the step and its
checkpoint are done), `before_save` (before that step's save starts), `mid_save` (inside the
save, once its first checkpoint file item is written: a partial checkpoint on disk, the other
ranks blocked in or past the save) or `in_flight` (the same, `IN_FLIGHT_S` later: a background
save every rank has staged, training going on beside it). Under torchrun a fault fires on the
first attempt only (`TORCHELASTIC_RESTART_COUNT` 0), so that a relaunch runs clean.

The train tests also share from here how they run a job and read its output: `micro_argv`,
`train_job` and `metrics`.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

from wholeshard import cli
from wholeshard.cli import build_parser
from wholeshard.distributed import stop
from wholeshard.train import trainer
from wholeshard.train.config import TrainConfig

WHENS = (trainer.AFTER_STEP, trainer.BEFORE_SAVE, "mid_save", "in_flight")
IN_FLIGHT_S = 2.0  # how long an `in_flight` fault lets the ranks train on beside the save
WAIT_S = 120  # a waiting worker's longest wait: a test that never stops it fails, never hangs


@dataclass(frozen=True)
class Fault:
    """Make `rank` fail at `step`, `when` (see the module docstring), the `kind` way."""

    rank: int
    step: int
    kind: str
    when: str = trainer.AFTER_STEP

    def __post_init__(self) -> None:
        kinds = ("raise", "exit", "kill", "node", "wait", "hold")
        if self.kind not in kinds or self.when not in WHENS:
            raise ValueError(f"bad fault {self}")

    @classmethod
    def parse(cls, spec: str) -> Fault:
        rank, step, *rest = spec.split(":")
        return cls(int(rank), int(step), *rest)

    def fire(self) -> None:
        if self.kind == "raise":
            raise RuntimeError(f"injected fault on rank {self.rank} at step {self.step}")
        if self.kind == "exit":
            os._exit(3)
        if self.kind == "wait":
            time.sleep(WAIT_S)
            raise RuntimeError(f"waited {WAIT_S} s at step {self.step}: nobody stopped the worker")
        if self.kind == "hold":
            hold = Path(os.environ["WHOLESHARD_TEST_HOLD"])
            (hold / "holding").write_text(f"rank {self.rank}, the save of step {self.step}")
            _until((hold / "release").exists, "released the save")
            return
        if self.kind == "node":
            os.kill(os.getppid(), signal.SIGKILL)  # torchrun's agent (its workers: own sessions)
        os.kill(os.getpid(), signal.SIGKILL)

    def __call__(self, point: str, step: int, rank: int) -> None:
        """The `trainer.Hook`."""
        if (rank, step) != (self.rank, self.step):
            return
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        if self.kind == "wait" and os.environ.get("WORLD_SIZE", "1") != "1":
            return  # (a node joined: torchrun's restart for it keeps the restart count)
        if point == self.when:
            self.fire()
        elif point == trainer.BEFORE_SAVE and self.when in ("mid_save", "in_flight"):
            write_item = dcp_fs._write_item

            def write_then_fail(*args, **kwargs):
                result = write_item(*args, **kwargs)
                if self.when == "in_flight":
                    time.sleep(IN_FLIGHT_S)
                self.fire()
                return result

            dcp_fs._write_item = write_then_fail
        elif point == trainer.AFTER_STEP and self.kind == "hold":
            _until(stop.requested, "asked the run to stop")


def _until(ready, what: str) -> None:
    """Wait until `ready()`, for at most `WAIT_S`."""
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"held for {WAIT_S} s: nobody {what}")
        time.sleep(0.01)


def faulty_train(cfg: TrainConfig, fault: Fault) -> dict:
    """`train` with `fault` installed: the worker entry point the tests launch."""
    return trainer.train(cfg, hooks=[fault])


@dataclass(frozen=True)
class Poison:
    """Make `rank`'s gradient of `param` (`what="grad"`) or its loss (`what="loss"`) non-finite
    in training step `step` (counted from 1 in this process: no resume)."""

    rank: int
    step: int
    what: str = "grad"
    param: str = "blocks.0.attn.o.weight"

    def install(self, model: torch.nn.Module) -> None:
        calls = [0]

        def poison(t: torch.Tensor) -> torch.Tensor | None:
            calls[0] += 1
            return t * float("inf") if calls[0] == self.step else None

        if self.what == "grad":
            dict(model.named_parameters())[self.param].register_hook(poison)
        else:
            model.register_forward_hook(lambda m, args, out: poison(out) if m.training else None)


def poisoned_train(cfg: TrainConfig, poison: Poison) -> dict:
    """`train` with `poison` installed on its rank's model: a worker entry point."""
    build = trainer.Trainer._build

    def build_poisoned(self: trainer.Trainer) -> None:
        build(self)
        if self.env.rank == poison.rank:
            poison.install(self.model)

    trainer.Trainer._build = build_poisoned
    return trainer.train(cfg)


@dataclass(frozen=True)
class Loaded:
    """A worker on a machine at its worst for `--newton-schulz auto`: its Newton-Schulz timings
    report `favour` 10000x faster than the rest (what load can do to a close call), and rank
    `victim` (if any) is SIGKILLed once, just before the run's first checkpoint (the file
    `marker` says it was)."""

    favour: str
    marker: str = ""
    victim: int | None = None

    def install(self) -> None:
        from wholeshard.train import checkpoints, newton_schulz

        def timed(ns, groups, device, limit):
            return (1e-5 if ns.name == self.favour else 0.1), len(groups)

        newton_schulz.step_seconds = timed
        save = checkpoints.RunCheckpoints.save

        def killed_once(run: checkpoints.RunCheckpoints, step: int, progress: dict) -> None:
            if int(os.environ["RANK"]) == self.victim and not os.path.exists(self.marker):
                Path(self.marker).write_text(f"killed before the checkpoint of step {step}")
                os.kill(os.getpid(), signal.SIGKILL)
            save(run, step, progress)

        checkpoints.RunCheckpoints.save = killed_once


def loaded_train(cfg: TrainConfig, loaded: Loaded) -> dict:
    """`train` with `loaded` installed: a worker entry point."""
    loaded.install()
    return trainer.train(cfg)


def run_train(argv: list[str], fault: Fault | Poison | Loaded) -> int:
    """Run the `wholeshard train ...` command line `argv` with every rank running
    `faulty_train` (or `poisoned_train`, `loaded_train`); returns the exit code."""
    args = build_parser().parse_args(argv)
    if isinstance(fault, Loaded):
        return args.run(args, worker=functools.partial(loaded_train, loaded=fault))
    if isinstance(fault, Poison):
        return args.run(args, worker=functools.partial(poisoned_train, poison=fault))
    return args.run(args, worker=functools.partial(faulty_train, fault=fault))


PINNED_NEWTON_SCHULZ = ("--newton-schulz", "torch_bf16")  # as `support`'s (this runs as a script)


def micro_argv(data: Path, out: Path, steps: int, eval_every: int, *extra: str) -> list[str]:
    """`wholeshard train` of the micro model on `data` into `out`: `steps` steps of 4 x 16
    tokens, one validation batch every `eval_every` steps, then `extra`."""
    return [
        "train", "--model", "micro", "--data", str(data), "--out", str(out),
        "--steps", str(steps), "--batch-size", "4", "--seq-len", "16",
        "--eval-every", str(eval_every), "--eval-batches", "1", *PINNED_NEWTON_SCHULZ, *extra,
    ]  # fmt: skip


def train_job(argv: list[str], out: Path, fault: Fault | Loaded | None = None) -> dict:
    """Run the command line `argv` in process (through `run_train` with a `fault`): its exit
    "code" and, if that is 0, the "summary" it wrote to `out`."""
    code = cli.main(argv) if fault is None else run_train(argv, fault)
    summary = json.loads((out / "summary.json").read_text()) if code == 0 else None
    return {"code": code, "summary": summary}


def metrics(out: Path) -> list[dict]:
    """The records of a run's `metrics.jsonl` in `out`."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


if __name__ == "__main__":
    sys.exit(run_train(sys.argv[2:], Fault.parse(sys.argv[1])))
