"""Layouts: the one way to plan and sync params otherwise than the design does.

[Note: layouts]
A `Layout` is a named rewrite of the plan `auto.decide` makes, registered once with
`register_layout` and asked for by name (`plan_for(..., layout=name)`,
`DataParallel(..., _variant=Variant(layout=name))`). It brings:
- `relayout(plan, specs) -> Plan`: its plan, made from the design's one-level plan (planned
  with its `strategy` where the caller leaves "auto"); its buckets may name its own sync
  schemes (`Bucket.scheme`), and its params may sit in one buffer of its own `kind`;
- `schemes`: the torch-free description of each of those sync schemes ([Note: sync schemes]
  in `sync`), which `capacity` prices and `wholeshard plan` shows;
- `kind` (optional) and `sharding` (what a rank owns of it, for reports): a buffer kind whose
  buckets have no shards (each is held whole by every rank) and whose params are whole, each
  owned by its `Placement.owner` (`buffer.register_kind`);
- `executable`: a function returning its engine half (`wholeshard.engine.layouts.Executable`:
  the executable half of each of its schemes, the storage unit class of its kind), called
  where an engine builds its plan, so that registering a layout imports no torch;
- `refuses`: the `DataParallelConfig` options it cannot run with, each with why.
Registering a layout registers its schemes and its kind with it, and the engine refuses a
layout whose engine half lacks one of its schemes' halves, so a description never runs without
its executable half. The core registers none; `wholeshard.bench.baselines` registers the
legacy baselines the bench compares against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .buffer import register_kind
from .plan import Plan, Strategy, two_level
from .specs import ParamSpec
from .sync import SyncScheme, register_scheme

Relayout = Callable[[Plan, tuple[ParamSpec, ...]], Plan]
"""(the design's one-level plan, its specs in registration order) -> the layout's plan."""


@dataclass(frozen=True)
class Layout:
    """A registered way to plan and sync params ([Note: layouts])."""

    name: str
    relayout: Relayout
    schemes: tuple[SyncScheme, ...]
    executable: Callable[[], Any]
    kind: str | None = None
    sharding: str = ""
    strategy: Strategy | None = None
    refuses: tuple[tuple[str, str], ...] = ()


LAYOUTS: dict[str, Layout] = {}
"""Every registered layout by name."""


def register_layout(layout: Layout) -> None:
    """Register `layout`, its sync schemes and its buffer kind ([Note: layouts]); registering
    the same one again is a no-op, another under a taken name a ValueError."""
    for scheme in layout.schemes:
        register_scheme(scheme)
    if layout.kind is not None:
        register_kind(layout.kind, layout.sharding)
    if LAYOUTS.setdefault(layout.name, layout) != layout:
        raise ValueError(f"a different layout is registered as {layout.name!r}")


def layout_named(name: str) -> Layout:
    """The layout registered as `name`; ValueError, saying what is registered and how to
    register one, otherwise."""
    if name not in LAYOUTS:
        raise ValueError(
            f"layout {name!r} is not registered (registered: {sorted(LAYOUTS) or 'none'}); "
            f"register one with wholeshard.planning.layouts.register_layout, or import the "
            f"module that does (the bench's baselines: import wholeshard.bench.baselines)"
        )
    return LAYOUTS[name]


def laid_out(layout: Layout, plan: Plan, specs: Sequence[ParamSpec], node_size: int | None) -> Plan:
    """`layout`'s plan of `plan` (the design's, for `specs`), in two levels of `node_size` ranks
    where its shard groups span nodes and its schemes allow ([Note: two-level groups] in
    `plan`), checked."""
    laid = layout.relayout(dataclasses.replace(plan, node_size=1), tuple(specs))
    laid = two_level(laid, node_size)
    laid.check(specs)
    return laid
