"""The registry of benchmarked configurations: one line each in `CONFIGS`.

A configuration is a name, a builder and an availability check. The builder runs on every rank
of a fresh process group: it wraps the workload's freshly built model and makes the optimizers,
and hooks whatever blocking it hides from Python into the rank's `WaitClock`. The check runs in
the launching process before any worker starts; a configuration that is unavailable (a missing
package, a keyword this version of `DataParallel` lacks) gets a row carrying the reason.

A wholeshard configuration also records its `DataParallel` keywords, so a run can override them
on every wholeshard configuration at once (`with_overrides`); wholeshard buckets are the
library's default size.

Every configuration uses the same hyperparameters (`MUON_KW`, `ADAMW_KW`), chosen so that
`torch.optim.Muon` and `muon.MuonWithAuxAdam` compute the same update: Nesterov momentum 0.95,
the "original" shape scaling `sqrt(max(1, rows / cols))`, AdamW eps 1e-10, no weight decay.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..routing import Route, route_params
from .floor import OwnedOptimizers, copy_with_grad
from .waits import WaitClock
from .workloads import Workload

MUON_KW: dict[str, Any] = dict(lr=0.02, momentum=0.95, weight_decay=0.0)
ADAMW_KW: dict[str, Any] = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
REFERENCE = "ddp_torch_muon"
"""The configuration every step time is compared with."""


@dataclass
class Setup:
    """A configuration built on one rank: what the timing loop drives."""

    model: nn.Module
    optimizers: list[torch.optim.Optimizer]
    after_backward: Callable[[], None] = lambda: None
    """Called after each backward; DDP uses it to book the comm hook's tail into the clock."""
    memory: Callable[[], dict[str, int]] | None = None
    """Bytes this rank holds between steps, by kind (`DataParallel.memory`); None when the
    configuration cannot say."""
    bare_model: Callable[[], nn.Module] | None = None
    """The model as this configuration computes it, unwrapped, for the floor (None: the
    workload's own)."""
    owned_optimizers: OwnedOptimizers | None = None
    """This rank's owned share for the floor (`floor.OwnedOptimizers`); None: every param
    under torch's Muon/AdamW, the share of a rank that updates everything."""

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)


Builder = Callable[[Workload, WaitClock], Setup]


@dataclass(frozen=True)
class Config:
    """A benchmarked configuration."""

    name: str
    description: str
    build: Builder
    unavailable: Callable[[], str | None] = field(default=lambda: None)
    """The reason this configuration cannot run here, or None."""
    ddp_kwargs: Mapping[str, Any] | None = None
    """A wholeshard configuration's `DataParallel` keywords; None for any other configuration."""


def split_params(model: nn.Module, workload: Workload) -> tuple[list, list]:
    """(Muon params, other params) by the workload's routing; a tied param appears once."""
    routes = route_params(model, workload.use_muon)
    return [r.param for r in routes if r.muon], [r.param for r in routes if not r.muon]


def torch_optimizers(model: nn.Module, workload: Workload) -> list[torch.optim.Optimizer]:
    """`torch.optim.Muon` on the matrices and `torch.optim.AdamW` on the rest (if any)."""
    return torch_pair(*split_params(model, workload))


def torch_pair(muon: list, other: list) -> list[torch.optim.Optimizer]:
    """`torch.optim.Muon` on `muon` and `torch.optim.AdamW` on `other`, each if not empty."""
    opts: list[torch.optim.Optimizer] = []
    if muon:
        opts.append(torch.optim.Muon(muon, adjust_lr_fn="original", **MUON_KW))
    if other:
        opts.append(torch.optim.AdamW(other, **ADAMW_KW))
    return opts


def every_param(routes: list[Route]) -> list[torch.optim.Optimizer]:
    """The floor's share of a rank that updates every param (torch DDP; FSDP2, whose
    `torch.optim.Muon` orthogonalizes every full matrix on every rank)."""
    copies = [(r.muon, copy_with_grad(r.param, r.param.grad)) for r in routes]
    return torch_pair([c for m, c in copies if m], [c for m, c in copies if not m])


# -- torch DDP -----------------------------------------------------------------------------


class _HookTail:
    """DDP's reducer waits for its all-reduces in C++, out of Python's sight. A comm hook
    equivalent to torch's default `allreduce_hook` timestamps each bucket's launch and
    completion; the tail, last completion minus last launch, is the time backward stayed
    blocked after its last gradient was ready."""

    def __init__(self, clock: WaitClock) -> None:
        self.clock = clock
        self.last_launch = 0.0
        self.last_done = 0.0

    # No annotations: DDP rejects a `bucket` annotation that is not the GradBucket class itself,
    # and `from __future__ import annotations` would make it a string.
    def hook(self, state, bucket):
        self.last_launch = time.perf_counter()
        buf = bucket.buffer().div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            self.last_done = max(self.last_done, time.perf_counter())
            return f.value()[0]

        return fut.then(done)

    def settle(self) -> None:
        self.clock.add(self.last_done - self.last_launch)
        self.last_launch = self.last_done = 0.0


def _ddp(model: nn.Module, clock: WaitClock) -> tuple[nn.Module, Callable[[], None]]:
    ddp = nn.parallel.DistributedDataParallel(model)
    tail = _HookTail(clock)
    ddp.register_comm_hook(None, tail.hook)
    return ddp, tail.settle


def _build_ddp_torch_muon(workload: Workload, clock: WaitClock) -> Setup:
    model = workload.make_model()
    ddp, settle = _ddp(model, clock)
    return Setup(ddp, torch_optimizers(model, workload), settle)


def _kj_unavailable() -> str | None:
    try:
        import muon  # noqa: F401
    except Exception as e:  # an import of a third-party package can fail in any way
        return f"cannot import muon (pip install muon-optimizer): {type(e).__name__}: {e}"
    return None


def _build_ddp_kj_muon(workload: Workload, clock: WaitClock) -> Setup:
    from muon import MuonWithAuxAdam

    model = workload.make_model()
    ddp, settle = _ddp(model, clock)
    muon, other = split_params(model, workload)
    groups = [dict(params=muon, use_muon=True, **MUON_KW)]
    if other:
        groups.append(dict(params=other, use_muon=False, **ADAMW_KW))
    return Setup(ddp, [MuonWithAuxAdam(groups)], settle, owned_optimizers=_kj_share)


def _kj_share(routes: list[Route]) -> list[torch.optim.Optimizer]:
    """`MuonWithAuxAdam`'s share: of the matrices sorted by size, largest first, every
    world-th from this rank's index (Newton–Schulz in bf16, its own); AdamW on every other
    param, which every rank updates."""
    from muon import SingleDeviceMuonWithAuxAdam

    rank, world = dist.get_rank(), dist.get_world_size()
    matrices = sorted((r for r in routes if r.muon), key=lambda r: r.param.size(), reverse=True)
    mine = [copy_with_grad(r.param, r.param.grad) for r in matrices[rank::world]]
    other = [copy_with_grad(r.param, r.param.grad) for r in routes if not r.muon]
    groups = [dict(params=mine, use_muon=True, **MUON_KW)] if mine else []
    if other:
        groups.append(dict(params=other, use_muon=False, **ADAMW_KW))
    return [SingleDeviceMuonWithAuxAdam(groups)] if groups else []


# -- torch FSDP2 ---------------------------------------------------------------------------


def _build_fsdp2_torch_muon(workload: Workload, clock: WaitClock) -> Setup:
    from torch.distributed.fsdp import fully_shard

    model = workload.make_model()
    for unit in workload.shard_units(model):
        fully_shard(unit)
    fully_shard(model)
    return Setup(model, torch_optimizers(model, workload))


# -- wholeshard ----------------------------------------------------------------------------


def _wholeshard_unavailable(ddp_kwargs: dict[str, Any]) -> Callable[[], str | None]:
    def check() -> str | None:
        from ..data_parallel import DataParallel

        params = inspect.signature(DataParallel.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return None
        missing = sorted(set(ddp_kwargs) - set(params))
        if missing:
            return f"not available in this version: DataParallel has no keyword {missing}"
        return None

    return check


def wholeshard_config(
    name: str, description: str, *, fp8: str | None = None, **ddp_kwargs: Any
) -> Config:
    """A configuration of `DataParallel(model, **ddp_kwargs)` + `LayerwiseOptimizer`; with
    `fp8`, the model's Muon-routed linears are converted to that FP8 recipe first."""

    def build(workload: Workload, clock: WaitClock) -> Setup:
        from ..data_parallel import DataParallel
        from ..optim import LayerwiseOptimizer

        def make_model() -> nn.Module:
            model = workload.make_model()
            if fp8 is not None:
                from .. import fp8 as fp8_module

                fp8_module.convert(model, fp8, use_muon=workload.use_muon)
            return model

        try:
            ddp = DataParallel(make_model(), use_muon=workload.use_muon, **ddp_kwargs)
        except TypeError as e:  # a keyword the availability check could not rule out
            if "unexpected keyword" not in str(e):
                raise
            raise RuntimeError(f"not available in this version: {e}") from e
        opt_kwargs: dict[str, Any] = dict(muon=dict(MUON_KW, adjust_lr_fn="original"))
        if "nonfinite" in inspect.signature(LayerwiseOptimizer).parameters:
            opt_kwargs["nonfinite"] = None  # the peers check nothing: compare like with like
        opt = LayerwiseOptimizer(ddp, adamw=ADAMW_KW, **opt_kwargs)
        return Setup(
            ddp,
            [opt],
            # A DataParallel older than `memory()` cannot report its persistent bytes.
            memory=getattr(ddp, "memory", None),
            bare_model=make_model,
            owned_optimizers=_planned_share(opt),
        )

    unavailable = _wholeshard_unavailable(ddp_kwargs)
    return Config(name, description, build, unavailable, ddp_kwargs=dict(ddp_kwargs))


def _planned_share(opt: Any) -> OwnedOptimizers:
    """A `LayerwiseOptimizer`'s share, its owned pieces under the plan, stepped as it steps
    them (`OwnedPiece.master` in the optimizer's layout; a piece of a param is its range of the
    flattened gradient)."""

    def build(routes: list[Route]) -> list[torch.optim.Optimizer]:
        grads = {r.name: r.param.grad.reshape(-1) for r in routes}
        muon, other = [], []
        for piece in opt.owned_pieces():
            flat = grads[piece.name][piece.offset : piece.offset + piece.param.numel()]
            grad = piece.oriented(flat.view(piece.param.shape))
            (muon if piece.kind == "muon" else other).append(copy_with_grad(piece.master, grad))
        return torch_pair(muon, other)

    return build


def with_overrides(name: str, overrides: Mapping[str, Any]) -> Config:
    """`CONFIGS[name]`, with `overrides` replacing its `DataParallel` keywords if it is a
    wholeshard configuration; any other configuration, or no overrides, returns it unchanged.
    The availability check sees the overridden keywords."""
    config = CONFIGS[name]
    if config.ddp_kwargs is None or not overrides:
        return config
    return wholeshard_config(config.name, config.description, **{**config.ddp_kwargs, **overrides})


# -- the registry: benchmarks run in this order ----------------------------------------------

CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config(
            "ddp_torch_muon",
            "torch DDP + torch.optim.Muon/AdamW: every rank orthogonalizes every matrix",
            _build_ddp_torch_muon,
        ),
        Config(
            "ddp_kj_muon",
            "torch DDP + muon.MuonWithAuxAdam (round-robin owners, all-reduce + all-gather)",
            _build_ddp_kj_muon,
            _kj_unavailable,
        ),
        Config(
            "fsdp2_torch_muon",
            "torch FSDP2 fully_shard per layer + torch.optim.Muon/AdamW on DTensors",
            _build_fsdp2_torch_muon,
        ),
        wholeshard_config("ws_sync", "wholeshard DataParallel + LayerwiseOptimizer, synchronous"),
        wholeshard_config(
            "ws_overlap",
            "wholeshard with grad-reduce and param-gather overlap",
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        ),
        wholeshard_config(
            "ws_pipelined",
            "ws_overlap with the pipelined step: each bucket updated as its reduction lands, "
            "gathered at once",
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            pipelined_step=True,
        ),
        wholeshard_config(
            "ws_fully_sharded",
            "wholeshard fully sharded (reshard after forward) + overlap, own all-gather group",
            reshard_after_forward=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        ),
        wholeshard_config(
            "ws_fully_sharded_one_group",
            "ws_fully_sharded with every collective on one process group",
            reshard_after_forward=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            separate_all_gather_group=False,
        ),
        wholeshard_config(
            "ws_fp8_mxfp8",
            "wholeshard overlap, MXFP8 linears, FP8 param gather (bf16 on the wire)",
            fp8="mxfp8",
            fp8_param_gather=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        ),
        wholeshard_config(
            "ws_fp8_tensorwise",
            "wholeshard overlap, tensorwise FP8 linears, FP8 bytes on the wire",
            fp8="tensorwise",
            fp8_param_gather=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        ),
        wholeshard_config("ws_ping_pong", "wholeshard, ping-pong layout", scheme="ping_pong"),
    )
}
