"""A plan's storage units ([Note: storage units] in the engine's `_storage`): `Unit`, and
`storage_units`, a plan's units in reduce order as `DataParallel` builds them. From the plan
and its specs alone: no model, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .plan import Plan
from .specs import Bucket, ParamSpec


@dataclass(frozen=True)
class Unit:
    """One storage unit: consecutive buckets of one buffer, `names` its params in registration
    order, `index` its place in reduce order; `numel` elements, `shard_numel` of one shard."""

    index: int
    kind: str
    names: tuple[str, ...]
    buckets: tuple[Bucket, ...]
    numel: int
    shard_numel: int


def storage_units(plan: Plan, specs: Sequence[ParamSpec]) -> list[Unit]:
    """The plan's storage units in reduce order (the unit holding the latest-registered param
    first), as `DataParallel` builds them from `plan` and its `specs` (registration order)."""
    registered = {s.name: i for i, s in enumerate(specs)}
    found = []
    for buffer in plan.buffers:
        runs = buffer.storage_units()
        run_of = {b: n for n, run in enumerate(runs) for b in run}
        members: list[list[str]] = [[] for _ in runs]
        for p in buffer.placements:
            members[run_of[p.bucket]].append(p.name)
        for run, names in zip(runs, members, strict=True):
            found.append((buffer.kind, buffer.buckets[run.start : run.stop], tuple(names)))
    found.sort(key=lambda unit: -max(registered[n] for n in unit[2]))
    units = []
    for i, (kind, buckets, names) in enumerate(found):
        numel = buckets[-1].end - buckets[0].start
        units.append(Unit(i, kind, names, buckets, numel, sum(b.shard_numel for b in buckets)))
    return units
