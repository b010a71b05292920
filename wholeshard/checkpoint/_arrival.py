"""The arrival check: every rank of the group calls `save_checkpoint` / `load_checkpoint`.

A collective that some rank never joins (the torch DDP habit `if rank == 0: save(...)`) waits
for the process group's timeout, 30 min for gloo by default, then fails without saying why. So
a save or load first checks in through torch.distributed's default store, which every backend
has, before it touches a collective or the disk:

    wholeshard/checkpoint/<group>/calls/<rank>        this rank's number of calls (n)
    wholeshard/checkpoint/<group>/<n>/<what>/arrived  the ranks that made call n as <what>
    wholeshard/checkpoint/<group>/<n>/<what>/verdict  "ok", or why call n was given up

<group> stands for the group's global ranks, so subgroups count separately. The verdict is set
once (compare_set): "ok" by the last rank to arrive, or the error by the first rank whose wait
ran out (`arrival_timeout()`). Every rank of call n acts on that one verdict, so either all go
on or all raise the same `CheckpointError`, and a rank arriving after the error raises it too.
Cost: three or four store round trips per call, and two small keys left in the store.
"""

from __future__ import annotations

import hashlib
import math
import os
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from .directory import CheckpointError

TIMEOUT_ENV = "WHOLESHARD_CHECKPOINT_ARRIVAL_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
_OK = b"ok"


def arrival_timeout() -> float:
    """Seconds a rank waits for the others at a save or load: the environment variable
    `TIMEOUT_ENV` if set (a number > 0), else 60."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: it must be a number of seconds > 0")
    return seconds


def all_arrive(group: ProcessGroup | None, what: str) -> None:
    """Return once every rank of `group` (None: the default group) has called `what` as its
    same-numbered checkpoint call; raise `CheckpointError` on every rank that called it if some
    rank did not within `arrival_timeout()`."""
    timeout = arrival_timeout()
    store = dist.distributed_c10d._get_default_store()
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    prefix = f"wholeshard/checkpoint/{len(ranks)}-{digest}"
    n = store.add(f"{prefix}/calls/{dist.get_rank()}", 1)
    call = f"{prefix}/{n}/{what}"
    if store.add(f"{call}/arrived", 1) == len(ranks):
        verdict = store.compare_set(f"{call}/verdict", "", _OK)
    else:
        try:
            store.wait([f"{call}/verdict"], timedelta(seconds=timeout))
            verdict = store.get(f"{call}/verdict")
        except RuntimeError:  # the wait ran out (DistStoreError; a FileStore's RuntimeError)
            late = [r for r in ranks if store.add(f"{prefix}/calls/{r}", 0) < n]
            arrived = store.add(f"{call}/arrived", 0)
            error = _error(what, arrived, ranks, late, timeout)
            verdict = store.compare_set(f"{call}/verdict", "", error)
    if verdict != _OK:
        raise CheckpointError(verdict.decode())


def _error(what: str, arrived: int, ranks: list[int], late: list[int], timeout: float) -> str:
    missing = f" (global rank {', '.join(map(str, late))} did not)" if late else ""
    return (
        f"{what} was called by only {arrived} of the {len(ranks)} ranks of its process group "
        f"within {timeout:g} s{missing}. Every rank must call save_checkpoint and "
        f"load_checkpoint, not only rank 0 (each rank saves and loads its own shard): call them "
        f"outside any `if rank == 0:`. If a rank is only slow to get there, raise "
        f"{TIMEOUT_ENV} (seconds, default {DEFAULT_TIMEOUT_S:g})"
    )
