"""What a wrapped model must be, and must stay: checks that turn misuse into clear errors.

- At construction (`placement_problem`): no param is wrapped already (by another
  `DataParallel`: its hooks would fire too), every param and buffer is materialised (not on the
  meta device), all params are on one device, and every param is contiguous (each param becomes
  a contiguous view of its unit: strides another tensor relies on would silently change).
- While wrapped (`claim`, `check_torch_optimizer`, `check_clip_params`): a torch optimizer
  stepping wrapped params, or `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` over them,
  raises instead of silently doing nothing (their `.grad` is always None: gradients live in the
  units, and `LayerwiseOptimizer` owns the step and the clipping). torch has no hook for the
  clipping, so the first `claim` puts checking wrappers in place of torch's ([Note: torch's
  clipping over wrapped params]).
- Foreign data-parallel wrappers (`foreign_wrapper_problem`, `outer_ddp_problem`): torch DDP or
  FSDP inside the wrapped module, or torch DDP around it (every gradient reduced twice, by
  hooks that find no `.grad`), are refused.
- In a fully sharded forward (`released_use_hint`): a param is empty from the end of the
  forward of the module holding it until its backward, so computing with it elsewhere in the
  forward (`h @ self.wte.weight.T` in a parent's forward) fails with torch's shape error; the
  error then also names the params released so far and the fix.
- After construction (`ParamSignature`): the same Parameter objects, in the same number, with
  the same `requires_grad`. Buffers are planned once, so a param frozen, unfrozen, replaced,
  added or removed after wrapping would train wrongly (its gradient never reduced, its update
  lost). `LayerwiseOptimizer.step` asks at every step, inside the all-reduce every rank takes,
  so all ranks raise together.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ._storage import UnitState

if TYPE_CHECKING:
    from ._schedule import Scheduler

_WRAPPED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # param -> its name in the wrapped module
_STEP_GUARD: list[Any] = []  # the handle of the global optimizer step pre-hook, once installed
_CLIP_GUARD: list[Any] = []  # torch's clipping functions, once our checking wrappers replaced them


def claim(params: Iterable[tuple[str, nn.Parameter]]) -> None:
    """Mark `params` (name, param) as wrapped, and make any torch optimizer that steps one of
    them raise (`check_torch_optimizer`)."""
    for name, p in params:
        _WRAPPED[p] = name
    if not _STEP_GUARD:
        _STEP_GUARD.append(register_optimizer_step_pre_hook(check_torch_optimizer))
    if not _CLIP_GUARD:
        _guard_clipping()


def unclaim(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        _WRAPPED.pop(p, None)


def check_torch_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Raise if `optimizer` holds a param wrapped by a `DataParallel`: its step would do nothing
    for it (the param's `.grad` is always None), silently."""
    if not _WRAPPED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _WRAPPED.get(p)
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() would not update {name!r}: the param is "
                    f"wrapped by wholeshard.DataParallel, so its .grad is always None (gradients "
                    f"live in DataParallel's units and are reduced to the rank that owns the "
                    f"param). wholeshard.LayerwiseOptimizer(ddp, matrix=..., adamw=...) owns the "
                    f"step; clip with its clip_grad_norm_ (torch.nn.utils.clip_grad_norm_ sees "
                    f"no gradient)"
                )


def wrapped_name(param: torch.Tensor) -> str | None:
    """The name `param` has in the module a `DataParallel` wraps, or None when none wraps it."""
    return _WRAPPED.get(param) if isinstance(param, nn.Parameter) else None


_CLIP_FIX = (
    "Clip with wholeshard.LayerwiseOptimizer.clip_grad_norm_(max_norm) (every rank): it clips "
    "the averaged gradients by the global norm and returns it"
)


def check_clip_params(params: Iterable[torch.Tensor], clipping: str = "clip_grad_norm_") -> None:
    """Raise if `params` holds a param wrapped by a `DataParallel`: `torch.nn.utils.<clipping>`
    would see no gradient for it (`clip_grad_norm_` would clip nothing and return 0, silently;
    `clip_grad_value_` would fail inside torch)."""
    for p in params:
        name = wrapped_name(p)
        if name is not None:
            raise RuntimeError(
                f"torch.nn.utils.{clipping} would not clip {name!r}: the param is wrapped by "
                f"wholeshard.DataParallel, so its .grad is always None (gradients live in "
                f"DataParallel's units, each rank holding the averaged gradient of what it "
                f"owns). {_CLIP_FIX}"
            )


def _guard_clipping() -> None:
    """Put wrappers that call `check_clip_params` first in place of torch's `clip_grad_norm_`
    and `clip_grad_value_` (where `torch.nn.utils.<name>` and frameworks look them up at call
    time; a reference bound before the first wrap keeps torch's).

    [Note: torch's clipping over wrapped params]
    A wrapped param's `.grad` is always None, so torch's clipping over it would clip nothing
    (`clip_grad_norm_` returns 0) or fail inside torch (`clip_grad_value_`). torch has no hook
    for either, so the first wrap puts these wrappers in place, for code a user writes (a loop
    calling `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`): given a wrapped param
    they raise naming `LayerwiseOptimizer.clip_grad_norm_`; given anything else they call
    torch's own function unchanged. The integrations do not rely on them: each checks its own
    framework's entry points."""
    from torch.nn import utils
    from torch.nn.utils import clip_grad

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        torch_clip = getattr(clip_grad, name)
        _CLIP_GUARD.append(torch_clip)
        checking = _checking(torch_clip, name)
        setattr(utils, name, checking)
        setattr(clip_grad, name, checking)


def _checking(torch_clip: Any, name: str) -> Any:
    @functools.wraps(torch_clip)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if _WRAPPED:
            parameters = [parameters] if torch.is_tensor(parameters) else list(parameters)
            check_clip_params(parameters, name)
        return torch_clip(parameters, *args, **kwargs)

    return clip


_FOREIGN_FIX = (
    "wholeshard.DataParallel reduces the gradients itself: build the model, wrap it in "
    "wholeshard.DataParallel alone (no DistributedDataParallel or FSDP inside or around it), "
    "and tell a framework not to wrap it again (the wholeshard.integrations do)"
)


def foreign_wrapper_problem(module: nn.Module) -> str | None:
    """Why `module` holds another data-parallel wrapper (torch DDP, FSDP1 or FSDP2), or None."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    foreign = (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)
    for name, m in module.named_modules():
        if isinstance(m, foreign):
            where = repr(name) if name else "the model itself"
            return f"{where} is a {type(m).__name__}: {_FOREIGN_FIX}"
    return None


def outer_ddp_problem() -> str | None:
    """Why the forward running now is wrong, or None: torch DDP's forward is running it (DDP
    around a `DataParallel`, as `accelerator.prepare(model)` makes by default)."""
    from torch.nn.parallel import DistributedDataParallel

    active = getattr(DistributedDataParallel, "_get_active_ddp_module", lambda: None)()
    if active is None:
        return None
    return f"a wholeshard.DataParallel runs inside torch's DistributedDataParallel: {_FOREIGN_FIX}"


SHAPE_WORDS = ("size", "shape", "dimension", "-D")
"""Words of torch's errors for an operand of the wrong shape (an empty param: `size mismatch`,
`The size of tensor a`, `shape [0]`, `'weight' must be 2-D`, `at least three dimensions`)."""


def released_use_hint(error: BaseException, schedulers: Iterable[Scheduler]) -> str | None:
    """What to add to `error`, raised by a forward, if it may come from computing with a param
    released earlier in that forward (fully sharded: after every module holding it ran), or
    None: no param was, or `error` is not torch's plain shape error."""
    if type(error) not in (RuntimeError, IndexError) or not any(
        w in str(error) for w in SHAPE_WORDS
    ):
        return None
    released = [  # in forward order: the first released first
        p.name
        for s in schedulers
        if s.reshard
        for u in s.forward_order
        if s.users[u.index] and s.forward_left[u.index] <= 0 and u.state is UnitState.RELEASED
        for _, p in u.params
    ]
    if not released:
        return None
    more = f" and {len(released) - 5} more" if len(released) > 5 else ""
    return (
        f"wholeshard: fully sharded (reshard_after_forward=True), a param is empty from the end "
        f"of the forward of the module holding it until its backward. If this forward computes "
        f"with one of those released so far ({', '.join(map(repr, released[:5]))}{more}) outside "
        f"the module holding it (`h @ self.wte.weight.T` in a parent's forward), call it through "
        f"a module instead (a head `nn.Linear` sharing the weight: `head.weight = wte.weight`, "
        f"then `head(h)`), or leave reshard_after_forward off"
    )


def placement_problem(module: nn.Module, placeholders: Collection[nn.Parameter] = ()) -> str | None:
    """Why `module` cannot be wrapped as it is, or None. `placeholders`: params standing in for
    meta ones until their buffers exist (`_meta`), exempt from the contiguity rule."""
    foreign = foreign_wrapper_problem(module)
    if foreign is not None:
        return foreign
    for name, p in module.named_parameters():
        if p in _WRAPPED:
            return (
                f"param {name!r} is already wrapped by a wholeshard.DataParallel (as "
                f"{_WRAPPED[p]!r}): a module is wrapped once. To wrap it again (after freezing "
                f"or unfreezing params, say), first take it back with ddp.release() on every "
                f"rank, or wrap a freshly built model"
            )
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_meta:
            return (
                f"{name!r} is on the meta device (not materialised): pass "
                f"DataParallelConfig(param_init=fn) to build from the meta device, or call "
                f"model.to_empty(device=...) and initialise or load the weights before wrapping"
            )
    devices: dict[torch.device, str] = {}
    for name, p in module.named_parameters():
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        where = ", ".join(f"{name!r} on {device}" for device, name in devices.items())
        return f"params are on several devices ({where}): move the whole model to one device first"
    for name, p in module.named_parameters():
        if not p.is_contiguous() and p not in placeholders:
            return (
                f"param {name!r} is not contiguous (shape {tuple(p.shape)}, stride {p.stride()}): "
                f"each param becomes a contiguous view of its unit, so make it contiguous "
                f"before wrapping (p.data = p.data.contiguous())"
            )
    return None


def device_problem(
    device: torch.device,
    *,
    backend: str,
    current: int,
    bound: torch.device | None,
    local_rank: int,
    local_world: int,
    visible: int,
) -> str | None:
    """Why a model on `device` cannot run collectives on `backend`, or None. NCCL runs on the
    current CUDA device (`current`; `bound`: the device bound to the group, if any); torchrun's
    `LOCAL_RANK` of `LOCAL_WORLD_SIZE` ranks on a node with `visible` GPUs tells a forgotten
    `torch.cuda.set_device` apart: every rank of the node on GPU 0."""
    if device.type != "cuda" or backend != "nccl":
        return None
    fix = (
        "call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init_process_group "
        "and before building the model, then build it on that device"
    )
    if device.index != current:
        return f"the model is on {device} but the current CUDA device is cuda:{current}: {fix}"
    if bound is not None and bound != device:
        return f"the model is on {device} but the process group is bound to {bound}: {fix}"
    if local_rank > 0 and current == 0 and visible >= local_world > 1:
        return (
            f"local rank {local_rank} of {local_world} is on cuda:0 while {visible} GPUs are "
            f"visible, so the node's ranks would share one GPU (NCCL refuses): {fix}"
        )
    return None


class ParamSignature:
    """The identity, count and `requires_grad` of a module's params when it was wrapped."""

    def __init__(self, module: nn.Module) -> None:
        self._names = {id(p): name for name, p in module.named_parameters()}
        self._key = self._of(module)

    @staticmethod
    def _of(module: nn.Module) -> list[tuple[int, bool]]:
        return [(id(p), p.requires_grad) for p in module.parameters()]

    def changes(self, module: nn.Module) -> str | None:
        """What changed in `module`'s params since wrapping, or None (cheap when nothing did)."""
        if self._of(module) == self._key:
            return None
        now = {id(p): (name, p) for name, p in module.named_parameters()}
        wrapped_requires_grad = dict(self._key)
        for key, name in self._names.items():
            if key not in now:
                names_now = {n for n, _ in now.values()}
                what = "replaced by a new Parameter" if name in names_now else "removed"
                return _changed(f"param {name!r} was {what}")
        for key, (name, p) in now.items():
            if key not in self._names:
                return _changed(f"param {name!r} was added")
            if p.requires_grad != wrapped_requires_grad[key]:
                return _changed(
                    f"param {name!r} has requires_grad={p.requires_grad}, "
                    f"{wrapped_requires_grad[key]} when it was wrapped"
                )
        return _changed("the params' order changed")


def _changed(what: str) -> str:
    return (
        f"the model changed after it was wrapped in DataParallel: {what}. The buffers are planned "
        f"once, at wrapping: freeze, replace or add params before wrapping (or take the module "
        f"back with ddp.release() on every rank, change it, and wrap it again)"
    )
