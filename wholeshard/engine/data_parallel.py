"""`DataParallel`: whole-tensor sharded gradient and parameter sync for one module.

What a training script calls is here: `forward`, `no_sync()`, `full_params()`,
`finish_param_sync()`, `free_overlap_buffers()`, `release()`, `memory()`. The optimizer drives
the step through `ddp.step_protocol` (`step_protocol.StepProtocol`: the step protocol, stated
there). It drives one `_sharded_group.ShardedGroup` per process group (the dense params';
with "ep" the experts'); `SHARDING` attributes are the dense group's. Other modules: the
package's docstring.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..distributed.dtensor import local, set_local
from ..distributed.groups import resolve_group
from ..distributed.mesh import ModelRanks, mesh_data_parallel, model_ranks
from ..planning import Plan
from ..planning.routing import Route, route_params
from ..planning.specs import MatrixCost, newton_schulz_cost
from . import _hooks as hooks
from ._experts import ExpertLayout, expert_group, split_experts, split_rest
from ._fp8_storage import has_fp8_weights
from ._guard import claim, outer_ddp_problem, released_use_hint, unclaim, wrapped_name
from ._init import cast_frozen, check_model, common_dtype
from ._memory import memory
from ._meta import fill_frozen, materialise, target_device
from ._sharded_group import CommGroupsMade, ShardedGroup
from ._storage import StorageUnit
from ._tp_check import check_tensor_parallel
from .config import DataParallelConfig, Variant
from .step_protocol import StepProtocol

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

SHARDING = ("plan", "shard_group_size", "shard_rank", "shard_group", "replica_group")
SHARDING += ("gather_group", "reshard_after_forward", "fp8_param_gather")


class DataParallel(nn.Module):
    """Wrap `module` (already on its device) for data-parallel training with whole-matrix owners.

    Args:
        module: the model; every rank must build the same one (construction checks this and
            raises on every rank, naming the first difference). Rank 0's initial values are
            broadcast to all ranks.
        config: a `DataParallelConfig`; or pass its fields as keyword arguments
            (`DataParallel(module, reshard_after_forward=True)`), not both.
        process_group: the data-parallel group; None: the default group (or one process when
            torch.distributed is not initialised).
        mesh: a `DeviceMesh` whose named dims say what each is, instead of `process_group`:
            `"dp"`, or `"dp_replicate"` x `"dp_shard"` (hybrid sharding, the mesh form of
            `shard_group_size`), beside `"pp"`, `"tp"` or `"ep"` (a MoE's experts: [Note:
            expert parallelism]) ([Note: mesh dims] in `wholeshard.distributed.mesh`).

    matrix-routed params live in whole-tensor buffers, the others in element-wise sharded ones
    (`plan`). The optimizer is `wholeshard.LayerwiseOptimizer(ddp, ...)`, which owns the step
    (driving it through `step_protocol`): the wrapped params' `.grad` stays None (gradients go
    to the units), so clip with `optimizer.clip_grad_norm_`; a torch optimizer over
    `ddp.parameters()` raises at its step; `ddp.zero_grad()` zeroes the units' gradients. A
    module is wrapped once (torch DDP or FSDP inside or around it is refused); `release()` gives
    it back.

    torch's clipping has no hook, so the first wrap replaces `torch.nn.utils.clip_grad_norm_`
    and `clip_grad_value_` (process-wide) with checking wrappers, for a loop calling them over
    `ddp.parameters()`: given a wrapped param they raise naming `LayerwiseOptimizer.
    clip_grad_norm_` (they would clip nothing, or fail inside torch); given anything else they
    are torch's own functions, unchanged. A reference bound before the first wrap (`from
    torch.nn.utils import clip_grad_norm_` at import time) is torch's, unchecked. The
    integrations do not rely on them ([Note: torch's clipping over wrapped params]).
    """

    dp_config: DataParallelConfig  # not `config`: that name is the wrapped model's (transformers)
    module: nn.Module
    routes: list[Route]  # every trainable param, in registration order
    frozen: list[nn.Parameter]  # params with requires_grad=False, outside the buffers
    plan: Plan
    process_group: ProcessGroup | None
    dp_size: int
    rank: int  # in `process_group`
    shard_group_size: int
    shard_rank: int  # in this rank's shard group
    tensor_parallel: bool  # some params are DTensors, held as their local shards
    model_ranks: ModelRanks  # the ranks holding one whole model: dp (x ep) (x tp)
    expert_layout: ExpertLayout | None  # with "ep": where this rank's experts sit among all
    reshard_after_forward: bool  # what the config asks, where there is anything to gather
    fp8_param_gather: bool  # likewise
    step_protocol: StepProtocol  # what the optimizer drives the step with

    def __init__(
        self,
        module: nn.Module,
        config: DataParallelConfig | None = None,
        *,
        process_group: ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
        _variant: Variant | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        cfg = DataParallelConfig.from_options(config, options)
        self._variant = variant = _variant or Variant()
        variant.check(cfg)
        policy = cfg.mp_policy or MixedPrecisionPolicy()
        meshed = None
        if mesh is not None:  # [Note: mesh dims]
            meshed = mesh_data_parallel(mesh, process_group, cfg.shard_group_size)
            process_group = meshed.group
            if meshed.shard_group_size is not None or meshed.expert_group is not None:
                cfg = dataclasses.replace(cfg, shard_group_size=meshed.shard_group_size)
        self.dp_config = cfg
        if cfg.fp8_param_gather and not has_fp8_weights(module):
            raise ValueError(
                "fp8_param_gather=True but the model has no FP8 layers: convert it first with "
                "wholeshard.fp8.convert(model, recipe) (before wrapping)"
            )
        self.module = module
        self.process_group, self.dp_size, self.rank = resolve_group(process_group)
        placeholders: set[nn.Parameter] = set()
        if cfg.param_init is not None:  # [Note: meta-device construction]
            placeholders = materialise(module, target_device(module, self.process_group))
            fill_frozen(module, cfg.param_init)
        self.routes = route_params(module, cfg.matrix_params)
        routes, experts = split_experts(module, self.routes, cfg, meshed)  # [Note: expert
        self.tensor_parallel = check_tensor_parallel(  # parallelism] in `distributed.mesh`
            self.routes,
            mesh.mesh_dim_names if mesh is not None else None,
            param_init=cfg.param_init is not None,
            fp8=cfg.fp8_param_gather,
        )
        self.model_ranks = model_ranks(
            mesh if self.tensor_parallel else None, self.process_group, self.dp_size, self.rank
        )
        check_model(module, routes, self.process_group, self.dp_size, placeholders)
        param_dtype = policy.param_dtype or common_dtype(self.routes)
        self.frozen = cast_frozen(module, param_dtype)
        dtypes = {"param_dtype": param_dtype, "grad_dtype": policy.reduce_dtype or param_dtype}
        rest = [*self.frozen, *module.buffers()]
        experts_rest: list[torch.Tensor] = []
        if experts:  # each group broadcasts its own
            rest, experts_rest = split_rest(module, self.frozen, cfg.expert_params)
        self._group_inputs = (routes, experts, meshed, rest, experts_rest, dtypes)
        self._build_groups(cfg, matrix_cost=None)
        self._hooks = hooks.cast_forward(module, policy)

    def _build_groups(
        self,
        cfg: DataParallelConfig,
        matrix_cost: MatrixCost | None,
        previous: Sequence[CommGroupsMade] = (),
    ) -> None:
        """Plan the params for `matrix_cost` (None: Newton-Schulz's), build their groups from
        the module's current values (reusing `previous` groups' comm groups where they fit) and
        the step protocol over them."""
        routes, experts, meshed, rest, experts_rest, dtypes = self._group_inputs
        kwargs = {"matrix_cost": matrix_cost, **dtypes}
        before = iter(previous)
        dense = ShardedGroup(
            self.module, routes, cfg, self._variant, self.process_group, rest=rest,
            previous=next(before, None), **kwargs,
        )  # fmt: skip
        self._groups, self.expert_layout = [dense], None  # `units` lists the experts' after
        if meshed is not None and experts:
            kwargs |= {"rest": experts_rest, "previous": next(before, None)}
            group, self.expert_layout = expert_group(self, cfg, experts, meshed, kwargs)
            self._groups.append(group)
        for name in SHARDING:  # the dense params' group's
            setattr(self, name, getattr(dense, name))
        claim((r.name, r.param) for r in self.routes)
        self._copy_of = {
            r.name: g.rank // g.shard_group_size for g in self._groups for r in g.routes
        }
        self.step_protocol = StepProtocol(self._groups, self.routes, self.module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        problem = outer_ddp_problem()
        if problem is not None:  # every rank runs the forward, so every rank raises
            raise RuntimeError(problem)
        try:
            return self.module(*args, **kwargs)
        except (RuntimeError, IndexError) as e:
            hint = released_use_hint(e, self.step_protocol.schedulers)
            if hint is None:
                raise
            raise type(e)(f"{e}\n\n{hint}").with_traceback(e.__traceback__) from None

    def __getattr__(self, name: str) -> Any:
        """The wrapped module's attribute where the wrapper has none (its `config`, say), as
        FSDP1 and accelerate's wrappers do, so code written for the model reads it here."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module" or "module" not in self._modules:
                raise
            return getattr(self._modules["module"], name)

    @property
    def units(self) -> list[StorageUnit]:
        """Communication units in reduce (backprop) order (the experts' after the others')."""
        return self.step_protocol.units

    def replica_of(self, name: str) -> int:
        """Which of the identical copies of param `name`'s owned elements this rank holds: its
        shard group's place among the dp / k groups (0 without hybrid sharding). Checkpoints
        write copy 0 alone."""
        if name not in self._copy_of:
            raise KeyError(f"{name!r} is not a trainable param of this model")
        return self._copy_of[name]

    @property
    def device(self) -> torch.device:
        """Where the buffers live: the module's device."""
        return self.units[0].param.device

    @property
    def comm_wait_s(self) -> float:
        """Seconds held up by collectives since construction (CUDA: read from events)."""
        return sum(s.wait_timer.seconds for s in self.step_protocol.schedulers)

    # -- gradients ------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffer, as the optimizer's `zero_grad()` does (frameworks call
        `model.zero_grad()` after the step: transformers' Trainer does). `set_to_none` is
        accepted for API parity and ignored (the params' `.grad` stays None)."""
        self.step_protocol.zero_grad_buffer()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block reduces them all."""
        previous = self._groups[0].scheduler.sync_grads  # every one's: they are set together
        for s in self.step_protocol.schedulers:
            s.sync_grads = False
        try:
            yield
        finally:
            for s in self.step_protocol.schedulers:
                s.sync_grads = previous

    # -- parameters -----------------------------------------------------------------------

    def finish_param_sync(self) -> None:
        """Complete every pending param sync: afterwards every param outside a released unit
        is up to date (in ZeRO-1/2 mode: every param). Call it before reading params outside
        a forward, `model.state_dict()` say (fully sharded: `full_params()`)."""
        self.step_protocol.finish_param_sync()

    @contextlib.contextmanager
    def full_params(self) -> Iterator[None]:
        """Every param materialised and up to date on every rank inside the block, for reading
        outside a forward (comparisons, export, `model.state_dict()`). Fully sharded, what it
        gathered is released on exit (writes to params are not kept); otherwise it completes
        pending gathers. Every rank must enter it."""
        gathered = [s.gather_all() for s in self.step_protocol.schedulers]
        try:
            yield
        finally:
            for s, g in zip(self.step_protocol.schedulers, gathered, strict=True):
                s.release(g)

    def release(self) -> nn.Module:
        """Take the module back (every rank must call it): each trainable param gets storage of
        its own holding its current value, every hook is removed, and the module can be wrapped
        again (after freezing or unfreezing params, say). Do not use this wrapper or its
        optimizer afterwards."""
        self._give_back_params()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        return self.module

    @staticmethod
    def wrapped_name(param: torch.Tensor) -> str | None:
        """The name `param` has in the module a `DataParallel` wraps (any of them), or None
        when none wraps it: integrations refuse to clip such params through torch."""
        return wrapped_name(param)

    def balance_for(self, rule: type) -> None:
        """Lay the params out again if the plan evens out another matrix rule's work than
        `rule`'s (its static `matrix_cost(rows, cols)`; Newton-Schulz's without one), so each
        rank's share of the matrix work is even: the layout decides which rank owns which
        matrix, so it follows the rule the optimizer is given. `LayerwiseOptimizer` calls it
        (every rank must), before it holds any state: the params keep their values, every
        unit's gradients are dropped and, for the moment, each rank holds a copy of the whole
        model besides its storage."""
        cost = getattr(rule, "matrix_cost", None)
        cost = None if cost is None or cost == newton_schulz_cost else cost
        if cost == self.plan.matrix_cost:
            return
        if self.step_protocol.optimizer is not None:
            name = getattr(rule, "__name__", rule)
            raise RuntimeError(
                f"this DataParallel already has an optimizer, whose state follows its layout; "
                f"build its one LayerwiseOptimizer with matrix_optimizer={name}"
            )
        self._give_back_params()
        previous = [g.made for g in self._groups]
        del self._groups, self.step_protocol  # the old units go before the new are built
        self._build_groups(dataclasses.replace(self.dp_config, param_init=None), cost, previous)

    def _give_back_params(self) -> None:
        """Give every trainable param storage of its own holding its current value, one unit
        at a time (fully sharded: gathered, copied, released), and remove the groups' hooks."""
        self.free_overlap_buffers()  # nothing in flight
        for s in self.step_protocol.schedulers:
            s.finish_param_sync()
            for unit in s.forward_order:
                gathered = s.gather([unit])
                values = [local(param.data).clone() for param, _ in unit.params]
                s.release(gathered)  # empties the params: they get their values after
                for (param, _), value in zip(unit.params, values, strict=True):
                    set_local(param, value)
        for g in self._groups:
            for handle in g.hooks:
                handle.remove()
            g.hooks = []
        unclaim(r.param for r in self.routes)

    def free_overlap_buffers(self) -> None:
        """Wait for anything in flight, then drop temporary buffers and (fully sharded) full
        units. Safe to repeat; call it before a checkpoint save."""
        self.finish_param_sync()
        for b in self.units:
            b.finish_reduce()
            b.drop_temporaries()
        if self.reshard_after_forward:
            for s in self.step_protocol.schedulers:
                s.release_all()

    # -- memory -----------------------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds between steps, by kind.

        `params` and `grads`: the unit storage kept between steps (this rank's shards when
        fully sharded, the full buffers otherwise); `masters` and `optimizer_state`: from the
        attached `LayerwiseOptimizer` (0 without one); `frozen_params`: params outside the
        buffers; `transient_unit`: the largest full param + grad unit that exists only
        during forward and backward (0 unless fully sharded). Where the kept bytes (all but
        `transient_unit`) are: `host`, the masters and state an optimizer made with
        `offload_state=True` keeps in host memory, and `device`, the rest.
        """
        optimizer = self.step_protocol.optimizer
        return memory(self.units, self.frozen, self.reshard_after_forward, optimizer)
