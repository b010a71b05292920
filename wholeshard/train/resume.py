"""Where a run starts: `find_checkpoint` (the checkpoint `checkpoint.resume` names, or None for
step 0), `check_start` (the run's checkpoint directory holds nothing its saves would replace),
`remove_checkpoints` (`--overwrite`), `saved_newton_schulz` (the implementation a resumed
`--newton-schulz auto` run keeps) and `newton_schulz_warning` (a resumed run stepping Muon
otherwise).

`find_checkpoint` and `check_start` only read files, and nothing writes checkpoints before the
first step, so every rank that calls them at the start of a run gets the same answer: an error
is raised on every rank, before any step. A run without `resume` whose checkpoint directory does
not exist reads nothing (nor imports torch.distributed.checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .config import TrainConfig

if TYPE_CHECKING:
    from .newton_schulz import NewtonSchulz

AUTO = "auto"
"""`checkpoint.resume` that resumes from `<out>/checkpoints`' latest checkpoint if there is one,
else starts at step 0 (the relaunch-safe choice for torchrun's `--max-restarts`)."""


def holds_checkpoints(root: Path) -> bool:
    """Whether `root` has a `latest` marker or a `step-N` directory."""
    if not root.is_dir():
        return False
    from ..checkpoint.directory import read_latest, steps

    return read_latest(root) is not None or bool(steps(root))


def find_checkpoint(cfg: TrainConfig) -> Path | None:
    """The checkpoint the run resumes from; None: it starts at step 0 (no `resume`, or `auto`
    with no checkpoint in `<out>/checkpoints`). Raises CheckpointError when `resume` names no
    complete checkpoint."""
    resume = cfg.checkpoint.resume
    if resume is None or (resume == AUTO and not holds_checkpoints(Path(cfg.checkpoint_dir))):
        return None
    from ..checkpoint.directory import resolve_checkpoint

    return resolve_checkpoint(cfg.resume_path)


def check_start(cfg: TrainConfig, ckpt: Path | None) -> None:
    """Raise CheckpointError if the run, starting from `ckpt` (None: step 0), has nothing to do
    (`ckpt` is past `optim.steps`) or would save over checkpoints in `<out>/checkpoints`: any
    at all when it starts at step 0, those after `ckpt` when it resumes from another one than
    `latest` names. (After `latest`, a `step-N` is a save killed before `latest` named it; the
    directory protocol replaces it when the resumed run saves step N.)"""
    root = Path(cfg.checkpoint_dir)
    if ckpt is None and not holds_checkpoints(root):
        return
    from ..checkpoint.directory import CheckpointError, read_latest, read_manifest, steps

    if ckpt is None:
        names = ", ".join(p.name for _, p in sorted(steps(root).items())) or "none"
        raise CheckpointError(
            f"{root} holds the checkpoints of an earlier run (latest: "
            f"{read_latest(root) or 'none'}; present: {names}), and this run starts at step "
            f"0: its saves would replace them. Continue that run with --resume auto (or "
            f"--resume latest), choose another --out, or pass --overwrite to delete them and "
            f"start over"
        )
    start = read_manifest(ckpt)["step"]  # the step it was saved at
    if start > cfg.optim.steps:
        raise CheckpointError(
            f"{ckpt} was saved at step {start}, past --steps {cfg.optim.steps}: nothing to "
            f"train. Pass --steps {start} or more"
        )
    later = [p.name for s, p in sorted(steps(root).items()) if s > start]
    latest = read_latest(root)
    if later and not (latest is not None and (root / latest).resolve() == ckpt.resolve()):
        raise CheckpointError(
            f"{root} holds {', '.join(later)}, after step {start} that this run resumes from "
            f"({ckpt}): its saves would replace them. Resume from the latest with --resume auto "
            f"(or --resume latest), choose another --out, or move them away"
        )


def remove_checkpoints(root: Path) -> None:
    """Delete every checkpoint in `root`: the `latest` marker first (so it never names a
    missing checkpoint), then each `step-N` directory (never left half-deleted), then what
    killed saves left."""
    if not root.is_dir():
        return
    from ..checkpoint.directory import LATEST, clean_leftovers, remove, steps

    (root / LATEST).unlink(missing_ok=True)
    for ckpt in steps(root).values():
        remove(root, ckpt)
    clean_leftovers(root)


def saved_newton_schulz(cfg: TrainConfig) -> str | None:
    """The `--newton-schulz` implementation the checkpoint this run resumes from ran (its
    `extra["newton_schulz"]`); None when it starts at step 0, the checkpoint recorded none, or
    cannot be read (`find_checkpoint` and the load say why, on every rank)."""
    import torch

    from ..checkpoint.directory import TRAINER, CheckpointError

    try:
        ckpt = find_checkpoint(cfg)
        if ckpt is None:
            return None
        extra = torch.load(ckpt / TRAINER, weights_only=True).get("extra")
    except (CheckpointError, OSError, RuntimeError):
        return None
    saved = extra.get("newton_schulz") if isinstance(extra, dict) else None
    return saved if isinstance(saved, str) else None


def newton_schulz_warning(saved: str | None, now: NewtonSchulz | None) -> str | None:
    """A warning when a resumed run runs Muon's Newton-Schulz with implementation `now` where the
    run it continues ran `saved` (`--newton-schulz` named another: `auto` keeps the saved one)."""
    if now is None or saved is None or saved == now.name:
        return None
    return (
        f"the checkpoint's run ran --newton-schulz {saved}, this one {now.name}: its updates "
        f"differ from an uninterrupted run's by a few bf16 roundings; pass --newton-schulz "
        f"{saved} to continue it bit for bit"
    )
