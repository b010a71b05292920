"""`DataParallel`: whole-tensor sharded gradient and parameter sync for one module.

What a training script calls is here: `forward`, `no_sync()`, `full_params()`,
`finish_param_sync()`, `free_overlap_buffers()`, `release()`, `memory()`. The optimizer drives
the step through `ddp.step_protocol` (`step_protocol.StepProtocol`: the step protocol, stated
there). The engine's other modules: the package's docstring.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..distributed import collectives
from ..distributed.dtensor import local, set_local
from ..distributed.groups import make_groups, resolve_group
from ..distributed.mesh import ModelRanks, mesh_data_parallel, model_ranks
from ..planning import Plan
from ..planning.routing import Route, route_params
from . import _hooks as hooks
from ._dtensor import check_tensor_parallel
from ._experts import ExpertLayout, ExpertPart, split_experts, the_rest, wrap_experts
from ._fp8_storage import has_fp8_weights
from ._guard import ParamSignature, claim, unclaim
from ._init import (
    broadcast_the_rest,
    build_storage,
    cast_frozen,
    check_model,
    common_dtype,
    forward_order,
    plan_routes,
    storage_factory,
)
from ._memory import memory
from ._meta import fill_frozen, fill_owned, materialise, target_device
from ._schedule import Scheduler
from ._storage import CommGroups, StorageUnit
from .config import DataParallelConfig, Variant
from .step_protocol import StepProtocol

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


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
    to the units), so clip with `optimizer.clip_grad_norm_`, not
    `torch.nn.utils.clip_grad_norm_` (it would see no gradient); a torch optimizer over
    `ddp.parameters()` raises at its step. A module is wrapped once; `release()` gives it back.
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
        _part: ExpertPart | None = None,
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
        if cfg.param_init is not None and not _part:  # [Note: meta-device construction]
            placeholders = materialise(module, target_device(module, self.process_group))
            fill_frozen(module, cfg.param_init)
        self.routes = _part.routes if _part else route_params(module, cfg.matrix_params)
        routes, experts = split_experts(module, self.routes, cfg, meshed)  # [Note: expert
        ep = bool(experts)  # parallelism] in `wholeshard.distributed.mesh`
        self.tensor_parallel = not _part and check_tensor_parallel(  # experts: checked by dense
            self.routes,
            mesh.mesh_dim_names if mesh is not None else None,
            param_init=cfg.param_init is not None,
            fp8=cfg.fp8_param_gather,
        )
        self.model_ranks = model_ranks(
            mesh if self.tensor_parallel else None, self.process_group, self.dp_size, self.rank
        )
        check_model(module, routes, self.process_group, self.dp_size, placeholders, bool(_part))
        param_dtype = policy.param_dtype or common_dtype(self.routes)
        self.frozen = cast_frozen(module, param_dtype)
        self.plan = plan_routes(routes, cfg, variant, self.dp_size)
        self.shard_group_size = self.plan.shard_group_size
        self.shard_rank = self.plan.shard_rank(self.rank)
        self._fill = cfg.param_init and fill_owned(self.plan, self.shard_rank, cfg.param_init)
        gathers = self.dp_size > 1 and self.shard_group_size > 1
        self.reshard_after_forward = cfg.reshard_after_forward and gathers
        self.fp8_param_gather = cfg.fp8_param_gather and gathers
        separate = variant.separate_all_gather_group
        if separate is None:
            separate = cfg.reshard_after_forward or cfg.pipelined_step
        self.shard_group, self.replica_group, self.gather_group = make_groups(
            self.process_group, self.dp_size, self.shard_group_size, separate and gathers
        )
        groups = CommGroups(
            self.shard_group,
            self.shard_rank,
            self.shard_group_size,
            self.gather_group,
            self.replica_group,
            variant.param_sync,
            _part.divide_by if _part else 0,
        )
        storages = build_storage(
            self.plan,
            routes,
            storage_factory(self.module, self.fp8_param_gather),
            self._fill_initial,
            groups=groups,
            reshard=self.reshard_after_forward,
            param_dtype=param_dtype,
            grad_dtype=policy.reduce_dtype or param_dtype,
        )
        if self.dp_size > 1:
            rest = [*self.frozen, *module.buffers()]
            if ep or _part:  # each side broadcasts its own
                rest = the_rest(module, self.frozen, cfg.expert_params, _part is not None)
            broadcast_the_rest(rest, self.process_group, storages[0].param.device)
        self._scheduler = Scheduler(
            storages,
            forward_order(storages, routes),
            reduces=self.dp_size > 1 or groups.divide_by > 1,  # experts at dp 1: the average
            gathers=gathers,
            overlap_grad_reduce=cfg.overlap_grad_reduce,
            overlap_param_gather=cfg.overlap_param_gather,
            reshard=self.reshard_after_forward,
            agree_group=self.process_group,
        )
        self._hooks = hooks.install(  # the experts' wrapper casts nothing: the dense one does
            self._scheduler,
            module,
            gathers,
            cfg.overlap_param_gather,
            self.fp8_param_gather,
            None if _part else policy,
        )
        signature = ParamSignature(module)
        # The experts' wrapper, before claiming ours: its check reads every param's claim.
        self._experts, self.expert_layout = wrap_experts(type(self), self, experts, meshed)
        claim((r.name, r.param) for r in routes)
        self.step_protocol = StepProtocol(
            self._scheduler,
            self.plan,
            self.shard_rank,
            self.routes,
            module,
            signature,
            [e.step_protocol for e in self._experts],
        )
        if self.fp8_param_gather or (self._fill and not self.reshard_after_forward):
            self._scheduler.params_updated()  # the owners' values (the first FP8 weights)
            self._scheduler.finish_param_sync()

    def _fill_initial(self, storage: StorageUnit) -> None:
        """Give a new storage unit rank 0's values (or, from `param_init`, its owned ones) and,
        fully sharded, keep only this rank's shards (units are filled one at a time: one full
        unit exists beside the model)."""
        if self._fill:
            self._fill(storage)
        elif self.dp_size > 1:
            collectives.broadcast_from_first(storage.param, self.process_group)
        if storage.reshard:
            storage.keep_shards()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

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
        return [b for s in self.step_protocol.schedulers for b in s.units]

    def replica_of(self, name: str) -> int:
        """Which of the identical copies of param `name`'s owned elements this rank holds: its
        shard group's place among the dp / k groups (0 without hybrid sharding). Checkpoints
        write copy 0 alone."""
        for e in (*self._experts, self):  # the dense wrapper's routes hold the experts' too
            if any(r.name == name for r in e.routes):
                return e.rank // e.shard_group_size
        raise KeyError(f"{name!r} is not a trainable param of this model")

    @property
    def device(self) -> torch.device:
        """Where the buffers live: the module's device."""
        return self.units[0].param.device

    @property
    def comm_wait_s(self) -> float:
        """Seconds held up by collectives since construction (CUDA: read from events)."""
        return sum(s.wait_timer.seconds for s in self.step_protocol.schedulers)

    # -- gradients ------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block reduces them all."""
        previous = self._scheduler.sync_grads  # every scheduler's: they are set together
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
        self.free_overlap_buffers()  # nothing in flight
        for s in self.step_protocol.schedulers:
            s.gather_all()
        for b in self.units:
            for param, _ in b.params:
                set_local(param, local(param.data).clone())
        for e in (self, *self._experts):
            for handle in e._hooks:
                handle.remove()
            e._hooks = []
        unclaim(r.param for r in self.routes)
        return self.module

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
        during forward and backward (0 unless fully sharded).
        """
        optimizer = self.step_protocol.optimizer
        return memory(self.units, self.frozen, self.reshard_after_forward, optimizer)
