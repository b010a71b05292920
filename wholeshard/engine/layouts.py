"""The engine half of a layout ([Note: layouts] in `wholeshard.planning.layouts`): what a
layout's `executable()` returns (`Executable`), what it builds from (`StorageUnit`, `SyncHalf`,
`InFlight` and the shard helpers, re-exported here as the one public face of the engine's sync),
and `load`, which the engine calls where it builds a layout's plan."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..planning.layouts import Layout
from ._storage import StorageUnit
from ._sync import (
    HALVES,
    InFlight,
    SyncHalf,
    place_mine,
    reduce_scatter_half,
    shard_views,
)

__all__ = [
    "Executable",
    "InFlight",
    "StorageUnit",
    "SyncHalf",
    "load",
    "place_mine",
    "reduce_scatter_half",
    "shard_views",
]


@dataclass(frozen=True)
class Executable:
    """A layout's engine half: the executable half of each of its sync schemes (`halves`, by
    scheme name) and, if it has a buffer kind, the `StorageUnit` subclass that holds it."""

    halves: Mapping[str, SyncHalf] = field(default_factory=dict)
    storage: type[StorageUnit] | None = None


def load(layout: Layout) -> Executable:
    """`layout`'s engine half, its schemes' halves made executable (`_sync.HALVES`); ValueError
    where one of its schemes has none, or its kind no storage class."""
    executable = layout.executable()
    lacks = [f"the executable half of sync scheme {s.name!r}" for s in layout.schemes
             if s.name not in executable.halves]  # fmt: skip
    if layout.kind is not None and executable.storage is None:
        lacks.append(f"the storage class of buffer kind {layout.kind!r}")
    if lacks:
        raise ValueError(f"layout {layout.name!r}: its engine half lacks {', '.join(lacks)}")
    for name, half in executable.halves.items():
        if HALVES.setdefault(name, half) != half:
            raise ValueError(f"a different executable half is loaded for sync scheme {name!r}")
    return executable
