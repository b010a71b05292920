"""Module hooks that tell the scheduler when params are needed.

[Note: hooked modules]
A param is waited for by the module that uses it directly: the module holding it in its own
`_parameters`. Two exceptions: a container (ModuleList, ParameterList, ...) is never called, so
the params it holds itself are used by the forward of its nearest callable ancestor, whose hook
waits for them; and a compiled module (`torch.compile(m)` or `m.compile()`) runs its submodules'
hooks inside its graph, so it is a leaf whose one hook, run eagerly, covers all of its params.
Hooks are `torch.compiler.disable`d: waiting on a collective cannot be traced, so a compiled
caller graph-breaks around them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.hooks import RemovableHandle

from ._schedule import Scheduler
from ._storage import StorageUnit

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def hooked_modules(root: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Every module that waits for params, with the params it waits for ([Note: hooked modules])."""
    from torch._dynamo.eval_frame import OptimizedModule

    params_of: dict[int, tuple[nn.Module, list[nn.Parameter]]] = {}
    seen: set[int] = set()
    todo: list[tuple[nn.Module, nn.Module]] = [(root, root)]
    while todo:
        mod, caller = todo.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        compiled = (
            isinstance(mod, OptimizedModule)
            or getattr(mod, "_compiled_call_impl", None) is not None
        )
        if not isinstance(mod, _CONTAINERS):
            caller = mod
        params = mod.parameters() if compiled else mod._parameters.values()
        params_of.setdefault(id(caller), (caller, []))[1].extend(p for p in params if p is not None)
        if not compiled:
            todo.extend((child, caller) for child in reversed(list(mod.children())))
    return list(params_of.values())


def register(
    scheduler: Scheduler,
    root: nn.Module,
    unit_of: dict[int, StorageUnit],
    *,
    reshard: bool,
) -> list[RemovableHandle]:
    """Hook every module that holds stored params (`unit_of`: param id -> its unit).

    Forward pre-hooks make the module's units gathered; when `reshard`, forward post-hooks
    count down and release them and hook the outputs' gradients to gather them again for
    backward, and the root's hooks open and close each forward.
    """
    handles = []
    for mod, params in hooked_modules(root):
        units = sorted({unit_of[id(p)] for p in params if id(p) in unit_of}, key=lambda b: b.index)
        if not units:
            continue
        for b in units:
            scheduler.users[b.index] += 1
        handles.append(mod.register_forward_pre_hook(_pre_forward(scheduler, units)))
        if reshard:
            # The root's output gradient arrives before any backward node runs: its own params
            # stay gathered for backward instead (as FSDP2 keeps its root's).
            announce = mod is not root
            handles.append(mod.register_forward_hook(_post_forward(scheduler, units, announce)))
    if reshard:
        handles.append(root.register_forward_pre_hook(_root_pre(scheduler), prepend=True))
        handles.append(root.register_forward_hook(_root_post(scheduler)))
    return handles


def grad_hooks(scheduler: Scheduler, units: Sequence[StorageUnit]) -> list[RemovableHandle]:
    """A post-accumulate-grad hook on every param of `units`, handing its grad to `scheduler`."""

    def hook(unit: StorageUnit, i: int, name: str) -> Callable[[torch.Tensor], None]:
        return lambda param: scheduler.receive_grad(unit, i, param, name)

    return [
        param.register_post_accumulate_grad_hook(hook(b, i, p.name))
        for b in units
        for i, (param, p) in enumerate(b.params)
    ]


def refuse_stale_reads(
    scheduler: Scheduler, root: nn.Module, unit_of: dict[int, StorageUnit]
) -> list[RemovableHandle]:
    """Make `state_dict()` of a module wait for the param syncs of its params already in flight,
    then raise while one of them is still not current: released (fully sharded between steps,
    an FP8-gathered weight) or updated but not gathered yet (`overlap_param_gather` after a
    step), instead of returning empty or stale values, different on each rank. Only syncs every
    rank dispatched are waited for: a rank calling it alone cannot hang."""
    handles = []
    for mod, params in hooked_modules(root):
        units = {unit_of[id(p)] for p in params if id(p) in unit_of}
        if units:
            handles.append(mod.register_state_dict_pre_hook(_refuse_stale(scheduler, list(units))))
    return handles


def cast_forward(root: nn.Module, policy: MixedPrecisionPolicy) -> list[RemovableHandle]:
    """The casts FSDP2's `MixedPrecisionPolicy` asks of the root's forward: its floating-point
    inputs to `param_dtype` (with `cast_forward_inputs`), its floating-point outputs to
    `output_dtype`."""

    def caster(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    handles = []
    if policy.param_dtype is not None and policy.cast_forward_inputs:
        to_param = caster(policy.param_dtype)

        def inputs(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            return tree_map_only(torch.Tensor, to_param, (args, kwargs))

        handles.append(root.register_forward_pre_hook(inputs, with_kwargs=True))
    if policy.output_dtype is not None:
        to_output = caster(policy.output_dtype)

        def outputs(module: nn.Module, args: Any, output: Any) -> Any:
            return tree_map_only(torch.Tensor, to_output, output)

        handles.append(root.register_forward_hook(outputs))
    return handles


def _pre_forward(scheduler: Scheduler, units: Sequence[StorageUnit]) -> Callable:
    @torch.compiler.disable
    def hook(module: nn.Module, args: Any) -> None:
        scheduler.pre_forward(units)

    return hook


def _post_forward(scheduler: Scheduler, units: Sequence[StorageUnit], announce: bool) -> Callable:
    """`announce`: hook the outputs' gradients to gather the units again for backward."""

    def pre_backward(grad: torch.Tensor) -> None:
        scheduler.pre_backward(units)

    @torch.compiler.disable
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        hookable = False
        if announce and torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(pre_backward)
                    hookable = True
        scheduler.post_forward(units, hookable)

    return hook


def _root_pre(scheduler: Scheduler) -> Callable:
    @torch.compiler.disable
    def hook(module: nn.Module, args: Any) -> None:
        scheduler.root_pre_forward()

    return hook


def _root_post(scheduler: Scheduler) -> Callable:
    @torch.compiler.disable
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        scheduler.root_post_forward()

    return hook


def _refuse_stale(scheduler: Scheduler, units: Sequence[StorageUnit]) -> Callable:
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if keep_vars:  # the Parameter objects themselves: they are updated in place
            return
        scheduler.wait_gathers(units)
        if all(b.readable for b in units):
            return
        where = prefix.rstrip(".") or "the model"
        if all(b.params_materialised for b in units):
            raise RuntimeError(
                f"{where}: params updated by the last optimizer step are not gathered yet "
                f"(overlap_param_gather gathers them during the next forward), so they differ "
                f"across ranks: call ddp.finish_param_sync() on every rank before reading them, "
                f"or read them inside `with ddp.full_params():` (every rank)"
            )
        raise RuntimeError(
            f"{where}: params are released between steps (fully sharded, or FP8-gathered "
            f"weights); read them inside `with ddp.full_params():` (every rank)"
        )

    return hook
