"""How each kind of benchmarked configuration is built on one rank (`build`), and whether it
can run here (`unavailable`).

The builder runs on every rank of a fresh process group: it wraps the workload's freshly built
model and makes the optimizers, and hooks whatever blocking it hides from Python into the
rank's `WaitClock`. Every configuration uses the same hyperparameters (`configs.MUON_KW`,
`configs.ADAMW_KW`); a wholeshard configuration steps its Muon matrices with the class its
`matrix_optimizer` names (`MATRIX_CLASSES`), and its floor share with the same class.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..engine.data_parallel import DataParallel
from ..optim import BatchedMuon, LayerwiseOptimizer
from ..planning.routing import Route, route_params
from .configs import ADAMW_KW, MUON_KW, BenchConfig
from .floor import OwnedOptimizers, copy_with_grad
from .rule_optimizers import (
    DEFAULT_RULE,
    KJ_RULE,
    MATRIX_KWARGS,
    RoundRobin,
    Rule,
    by_size,
    rule_optimizer,
    rule_sensitive,
    rule_unavailable,
)
from .wait_clock import WaitClock
from .workloads import Workload

MATRIX_CLASSES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "torch": (torch.optim.Muon, {}),
    **{name: (BatchedMuon, kwargs) for name, kwargs in MATRIX_KWARGS.items()},
}
"""`configs.MATRIX_OPTIMIZERS` by name: (class, keywords beyond `MUON_KW`)."""

TORCH_MUON_PEERS = frozenset({"ddp_torch_muon", "fsdp2_torch_muon"})
"""The peers that hand every matrix-routed param, whole, to `torch.optim.Muon`."""


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


def split_params(model: nn.Module, workload: Workload) -> tuple[list, list]:
    """(Muon params, other params) by the workload's routing; a tied param appears once."""
    routes = route_params(model, workload.matrix_params)
    return [r.param for r in routes if r.matrix], [r.param for r in routes if not r.matrix]


def torch_pair(
    muon: list, other: list, matrix: str = "torch", rule: Rule = DEFAULT_RULE
) -> list[torch.optim.Optimizer]:
    """The `matrix` optimizer (`MATRIX_CLASSES`; torch's Muon by default) under `rule`
    (`rule_optimizers.rule_optimizer`) on `muon` and `torch.optim.AdamW` on `other`, each if not
    empty."""
    opts: list[torch.optim.Optimizer] = []
    if muon:
        cls, kwargs = rule_optimizer(rule, matrix)
        opts.append(cls(muon, **kwargs))
    if other:
        opts.append(torch.optim.AdamW(other, **ADAMW_KW))
    return opts


def _copies(routes: list[Route], round_robin: bool = False) -> tuple[list, list]:
    """Fresh copies with their grads of the matrices a rank steps and of the other params: every
    matrix, or with `round_robin` the KJ-style share (the matrices sorted by size, largest first,
    every world-th from this rank's index)."""
    matrices = [r.param for r in routes if r.matrix]
    if round_robin:
        matrices = by_size(matrices)[dist.get_rank() :: dist.get_world_size()]
    other = [r.param for r in routes if not r.matrix]
    return [copy_with_grad(p, p.grad) for p in matrices], [copy_with_grad(p, p.grad) for p in other]


def every_param(routes: list[Route]) -> list[torch.optim.Optimizer]:
    """The floor's share of a rank that updates every param (torch DDP; FSDP2, whose
    `torch.optim.Muon` orthogonalizes every full matrix on every rank)."""
    return torch_pair(*_copies(routes))


# -- torch peers ---------------------------------------------------------------------------


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

    def book_tail(self) -> None:
        self.clock.add(self.last_done - self.last_launch)
        self.last_launch = self.last_done = 0.0


def _build_peer(name: str, workload: Workload, clock: WaitClock, rule: Rule) -> Setup:
    """The torch peer `name`: FSDP2, or DDP with its comm hook's tail booked into `clock`."""
    model = workload.make_model()
    if name == "fsdp2_torch_muon":
        from torch.distributed.fsdp import fully_shard

        for unit in workload.shard_units(model):
            fully_shard(unit)
        fully_shard(model)
        return Setup(model, torch_pair(*split_params(model, workload)))
    ddp = nn.parallel.DistributedDataParallel(model)
    tail = _HookTail(clock)
    ddp.register_comm_hook(None, tail.hook)
    muon, other = split_params(model, workload)
    if name == "ddp_torch_muon":
        return Setup(ddp, torch_pair(muon, other), tail.book_tail)
    if name == "ddp_kj_muon":
        from muon import MuonWithAuxAdam

        opt = MuonWithAuxAdam(_aux_adam_groups(muon, other))
        return Setup(ddp, [opt], tail.book_tail, owned_optimizers=_kj_share)
    if name != KJ_RULE:
        raise KeyError(f"no torch peer is called {name!r}")
    # `RoundRobin` of `rule` over DDP's replicated params (`rule_optimizers` module note)
    ordered = by_size(muon)
    rank, world = dist.get_rank(), dist.get_world_size()
    robin = RoundRobin(torch_pair(ordered[rank::world], other, rule=rule), ordered)

    def share(routes: list[Route]) -> list[torch.optim.Optimizer]:
        return torch_pair(*_copies(routes, round_robin=True), rule=rule)

    return Setup(ddp, [robin], tail.book_tail, owned_optimizers=share)  # type: ignore[list-item]


def _kj_unavailable() -> str | None:
    try:
        import muon  # noqa: F401
    except Exception as e:  # an import of a third-party package can fail in any way
        return f"cannot import muon (pip install muon-optimizer): {type(e).__name__}: {e}"
    return None


def _aux_adam_groups(muon: list, other: list) -> list[dict[str, Any]]:
    """`MuonWithAuxAdam`'s param groups: Muon on `muon`, AdamW on `other`, each if not empty."""
    groups = [dict(params=muon, use_muon=True, **MUON_KW)] if muon else []
    if other:
        groups.append(dict(params=other, use_muon=False, **ADAMW_KW))
    return groups


def _kj_share(routes: list[Route]) -> list[torch.optim.Optimizer]:
    """`MuonWithAuxAdam`'s share: its round-robin matrices (Newton–Schulz in bf16, its own) and
    AdamW on every other param, which every rank updates."""
    from muon import SingleDeviceMuonWithAuxAdam

    groups = _aux_adam_groups(*_copies(routes, round_robin=True))
    return [SingleDeviceMuonWithAuxAdam(groups)] if groups else []


# -- wholeshard ----------------------------------------------------------------------------


def _build_wholeshard(
    config: BenchConfig, workload: Workload, clock: WaitClock, rule: Rule = DEFAULT_RULE
) -> Setup:
    """`DataParallel(model, config.parallel)` + `LayerwiseOptimizer` stepping the matrices with
    `config.matrix_optimizer` under `rule`; with `config.fp8`, the model's matrix-routed linears
    are converted to that FP8 recipe first."""
    parallel = dataclasses.replace(config.parallel, matrix_params=workload.matrix_params)

    def make_model() -> nn.Module:
        model = workload.make_model()
        if config.fp8 is not None:
            from ..fp8 import convert

            convert(model, config.fp8, matrix_params=workload.matrix_params)
        return model

    ddp = DataParallel(make_model(), parallel, _variant=config.variant)
    cls, kwargs = rule_optimizer(rule, config.matrix_optimizer)
    opt = LayerwiseOptimizer(
        ddp,
        matrix=kwargs,
        adamw=ADAMW_KW,
        nonfinite=None,  # the peers check nothing: compare like with like
        matrix_optimizer=cls,
    )

    def share(routes: list[Route]) -> list[torch.optim.Optimizer]:
        """`opt`'s owned pieces under the plan, stepped as it steps them (`OwnedPiece.master` in
        the optimizer's orientation; a piece of a param is its range of the flattened gradient)."""
        grads = {r.name: r.param.grad.reshape(-1) for r in routes}
        muon, other = [], []
        for piece in opt.owned_pieces():
            flat = grads[piece.name][piece.offset : piece.offset + piece.param.numel()]
            grad = piece.oriented(flat.view(piece.param.shape))
            (muon if piece.kind == "matrix" else other).append(copy_with_grad(piece.master, grad))
        return torch_pair(muon, other, config.matrix_optimizer, rule)

    return Setup(ddp, [opt], memory=ddp.memory, bare_model=make_model, owned_optimizers=share)


def build(
    config: BenchConfig, workload: Workload, clock: WaitClock, rule: Rule = DEFAULT_RULE
) -> Setup:
    """Build `config` on this rank, its matrices under `rule` if it is rule-sensitive."""
    if config.parallel is not None:
        return _build_wholeshard(config, workload, clock, rule)
    return _build_peer(config.name, workload, clock, rule)


def unavailable(
    config: BenchConfig, workload: Workload | None = None, rule: Rule = DEFAULT_RULE
) -> str | None:
    """Why `config` cannot run here, or on `workload` when given, or under `rule`, or None
    (checked before any worker starts)."""
    if rule_sensitive(config):
        reason = rule_unavailable(rule, config.matrix_optimizer)
        if reason is not None:
            return reason
    if workload is not None and workload.stacked:
        if config.name in TORCH_MUON_PEERS:
            return (
                f"torch.optim.Muon steps 2-D params only, and {workload.name} has 3-D expert "
                f"stacks (wholeshard steps each matrix of a stack as a param of its own)"
            )
        if config.name == KJ_RULE:
            return f"{KJ_RULE} steps each matrix param whole; {workload.name} has 3-D stacks"
        if config.fp8 is not None:
            return f"FP8 converts nn.Linear layers, and {workload.name} has stacked params instead"
    return _kj_unavailable() if config.name == "ddp_kj_muon" else None
