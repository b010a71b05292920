"""Expert params under a mesh's "ep" dim ([Note: expert parallelism] in
`wholeshard.distributed.mesh`): which they are, what each side broadcasts, where they sit in
the whole MoE (`ExpertLayout`: checkpoints, the step check's flags) and the whole MoE's values
from the meta device (`whole_moe_init`).

`DataParallel` holds two `ShardedGroup`s: the dense params' (over dp x ep) and the experts'
(over the expert-data-parallel group, built by `expert_group`), each with its own plan, units
and schedule; it drives both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.dtensor import Place, is_tensor_parallel, on_experts_dim
from ..planning.routing import Route, clean_name
from ._init import check_model
from ._meta import ParamInit, seeded
from ._sharded_group import ShardedGroup

if TYPE_CHECKING:
    from ..distributed.mesh import MeshGroups
    from ..planning.routing import MatrixParams
    from .config import DataParallelConfig


def is_expert(name: str, param: torch.Tensor) -> bool:
    """The default `expert_params`: a name with an `experts` part (`mlp.experts.w1`,
    `experts.3.up.weight`; not `shared_experts.w1`)."""
    return "experts" in name.split(".")


def expert_rule(expert_params: MatrixParams | None) -> MatrixParams:
    """Which tensors are experts': `expert_params` (default `is_expert`), and every DTensor on
    an "ep" dim (the one decision; every use of it asks here)."""
    fn = expert_params or is_expert
    return lambda name, t: fn(name, t) or on_experts_dim(t)


def split_experts(
    module: nn.Module, routes: list[Route], cfg: DataParallelConfig, meshed: MeshGroups | None
) -> tuple[list[Route], list[Route]]:
    """(dense routes, expert routes), each in registration order; without an "ep" dim (in
    `meshed`), (routes, []). Raises if nothing is an expert (an "ep" dim with no experts is a
    mistake) or everything is."""
    if meshed is None or meshed.expert_group is None:
        return routes, []
    fn = expert_rule(cfg.expert_params)
    mine = {id(r) for r in routes if fn(r.name, r.param)}
    experts = [r for r in routes if id(r) in mine]
    dense = [r for r in routes if id(r) not in mine]
    if cfg.param_init is not None and (
        any(on_experts_dim(r.param) for r in experts)
        or any(fn(clean_name(n), p) for n, p in module.named_parameters() if not p.requires_grad)
    ):
        raise NotImplementedError(
            "param_init (meta-device construction) with experts that are DTensors or frozen"
        )
    if not experts:
        raise ValueError(
            f"the mesh has an 'ep' dim of {meshed.ep} but no trainable param is an expert's "
            f"(default: names with an 'experts' part): say which with "
            f"expert_params=fn(name, param)"
        )
    if not dense:
        raise ValueError(
            "every trainable param is an expert's: a MoE with an 'ep' dim also has dense params "
            "(a router, attention, embeddings); check expert_params"
        )
    tied = [r.name for r in experts if r.tied]
    if tied:
        raise ValueError(f"expert params {tied} are tied to another param: untie them")
    sliced = [r.name for r in experts if is_tensor_parallel(r.param)]
    if sliced:
        raise NotImplementedError(
            f"expert params {sliced[:4]} are sliced by tensor parallelism: experts are split "
            f"over 'ep' and replicated over 'tp' (leave them out of parallelize_module's plan)"
        )
    return dense, experts


def expert_group(
    dense: Any,
    cfg: DataParallelConfig,
    experts: list[Route],
    meshed: MeshGroups,
    kwargs: dict[str, Any],
) -> tuple[ShardedGroup, ExpertLayout]:
    """The experts' `ShardedGroup` (over the expert-data-parallel group, its gradients divided
    by dp x ep: `dense.dp_size`) and the layout checkpoints read, for the `DataParallel`
    `dense` (its dense params' group built) configured by `cfg`; `kwargs` go to `ShardedGroup`."""
    mine, group = {id(r) for r in experts}, meshed.expert_group
    flags = tuple(id(r) in mine for r in dense.routes)
    rule = cfg.expert_params
    layout = ExpertLayout(meshed.ep_rank, meshed.ep, dist.get_rank(group), rule, flags)
    cfg = dataclasses.replace(cfg, shard_group_size=meshed.expert_shard_group_size)
    if cfg.param_init is not None:
        shapes = {r.name: r.shape for r in experts}
        cfg = dataclasses.replace(cfg, param_init=whole_moe_init(cfg.param_init, layout, shapes))
    check_model(dense.module, experts, group, dist.get_world_size(group), placed=True)
    kwargs = {**kwargs, "divide_by": dense.dp_size}
    return ShardedGroup(dense.module, experts, cfg, dense._variant, group, **kwargs), layout


def whole_moe_init(
    fn: ParamInit, layout: ExpertLayout, shapes: dict[str, tuple[int, ...]]
) -> ParamInit:
    """`fn` (a `param_init`) giving this rank's experts the whole MoE's values, so they do not
    depend on ep either: an `experts.<i>` module's tensors are filled under their name in the
    whole MoE, a stack of experts as its rows of the whole stack (filled whole: transient
    memory of one whole stack)."""
    places = layout.places(shapes)

    def init(name: str, t: torch.Tensor) -> None:
        whole, shape, place = places[name]
        if place is None:
            seeded(fn, whole, t)
            return
        full = t.new_empty(shape)
        seeded(fn, whole, full)
        t.copy_(full.narrow(place[0], place[1], t.shape[place[0]]))

    return init


def split_rest(
    module: nn.Module, frozen: list[nn.Parameter], expert_params: MatrixParams | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Frozen params and buffers: (the dense params' group's, the experts' group's), what each
    group broadcasts from its first rank."""
    fn = expert_rule(expert_params)
    frozen_ids = {id(p) for p in frozen}
    named = [(n, t) for n, t in module.named_parameters() if id(t) in frozen_ids]
    named += list(module.named_buffers())
    sides: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for n, t in named:
        sides[bool(fn(clean_name(n), t))].append(t)
    return sides


@dataclass(frozen=True)
class ExpertLayout:
    """Where this rank's experts sit among all of them, this rank being `rank` of an "ep" dim of
    `size`: of n local experts, its `experts.<i>` modules are experts `rank * n + i`, and a
    stack's dim 0 (any other expert tensor) holds experts `[rank * n, (rank + 1) * n)`.
    Checkpoints name and place expert tensors by it, so they load at any ep size."""

    rank: int
    size: int
    data_rank: int  # in the expert-data-parallel group: rank 0 writes the experts' buffers
    expert_params: MatrixParams | None
    expert_routes: tuple[bool, ...]  # per route of the model: an expert's

    def spread(self, flags: Sequence[bool]) -> list[bool]:
        """Per-route `flags` laid out for a MAX over dp x ep: an expert route's in the slot of
        this rank's ep place among `size` (the others False), so only ranks holding the same
        expert agree on it (whether some rank got a gradient for it); `pick` reads them back."""
        out = [f and not e for f, e in zip(flags, self.expert_routes, strict=True)]
        for f, e in zip(flags, self.expert_routes, strict=True):
            out += [f and j == self.rank for j in range(self.size)] if e else []
        return out

    def pick(self, agreed: Sequence[bool]) -> list[bool]:
        """Per route: `agreed` (the MAX of `spread`s) at this rank's slots."""
        slots = iter(range(len(self.expert_routes) + self.rank, len(agreed), self.size))
        per_route = zip(agreed[: len(self.expert_routes)], self.expert_routes, strict=True)
        return [agreed[next(slots)] if e else a for a, e in per_route]

    def is_expert(self, name: str, t: torch.Tensor) -> bool:
        return expert_rule(self.expert_params)(name, t)

    def places(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, Place]:
        """Each of `shapes` (every plain expert tensor of the model: name -> local shape; a
        DTensor's own layout places it) placed in the whole model."""
        counts: dict[tuple[str, ...], set[str]] = {}
        for name in shapes:
            parts = name.split(".")
            i = _module_index(parts)
            if i is not None:
                counts.setdefault(tuple(parts[:i]), set()).add(parts[i])
        out: dict[str, Place] = {}
        for name, shape in shapes.items():
            parts = name.split(".")
            i = _module_index(parts)
            if i is not None:
                n = len(counts[tuple(parts[:i])])
                parts[i] = str(self.rank * n + int(parts[i]))
                out[name] = (".".join(parts), shape, None)
            elif not shape:
                raise ValueError(
                    f"expert tensor {name!r} is a scalar: an expert tensor is one of an "
                    f"`experts.<i>` module, or a stack whose dim 0 is the experts"
                )
            else:
                whole = (shape[0] * self.size, *shape[1:])
                out[name] = (name, whole, (0, self.rank * shape[0]))
        return out


def _module_index(parts: list[str]) -> int | None:
    """The position of `<i>` in a name `....experts.<i>....`, if it has one."""
    for i in range(1, len(parts)):
        if parts[i - 1] == "experts" and parts[i].isdigit():
            return i
    return None
