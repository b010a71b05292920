"""The muon path of the train job (`--optimizer muon`, the default): the model wrapped in
wholeshard's `DataParallel` and stepped by `LayerwiseOptimizer`, the hidden matrices by the rule
`optim.matrix_optimizer` names (`wholeshard.optim.rules`; `muon` run as `optim.newton_schulz`
says: `newton_schulz`), the rest by AdamW; with `optim.qk_clip`, MuonClip after every update
(`wholeshard.optim.QKClip`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..engine.data_parallel import DataParallel
from ..optim import LayerwiseOptimizer, QKClip
from ..optim.rules import matrix_kwargs, matrix_rule
from ..planning.specs import matrix_count, matrix_shape
from .baseline import ADAMW_BETAS
from .config import TrainConfig
from .newton_schulz import NewtonSchulz, choose
from .resume import saved_newton_schulz


def build_wholeshard(
    model: nn.Module, cfg: TrainConfig, param_dtype: torch.dtype, mesh: Any = None
) -> tuple[DataParallel, LayerwiseOptimizer, Callable[[float], torch.Tensor], NewtonSchulz | None]:
    """(the module to call, the optimizer, the gradient clipper, how `muon` runs Newton-Schulz
    (None for the other rules)) of `model` as `cfg` says, on `mesh` (a ("dp", "tp")
    `DeviceMesh` for a tensor-parallel model; None: the default group). The layout evens out the
    rule's own work per matrix (`DataParallel.balance_for`, which the optimizer calls)."""
    optim = cfg.optim
    ns = optim.ns_coefficients, optim.ns_algorithm
    parallel = dataclasses.replace(
        cfg.parallel,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        fp8_param_gather=cfg.model.fp8 is not None,
    )
    ddp = DataParallel(model, parallel, mesh=mesh)
    implementation = newton_schulz_of(ddp, cfg) if optim.matrix_optimizer == "muon" else None
    rule, extra = matrix_rule(optim.matrix_optimizer, *ns), {}
    if implementation is not None:
        rule, extra = implementation.rule, implementation.kwargs
    lr, weight_decay = cfg.peak_lr, optim.weight_decay
    opt = LayerwiseOptimizer(
        ddp,
        matrix_optimizer=rule,
        matrix=matrix_kwargs(optim.matrix_optimizer, lr, weight_decay, *ns) | extra,
        adamw=dict(lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay),
        nonfinite=optim.on_nonfinite,
        offload_state=optim.offload_state,
    )
    if optim.qk_clip is not None:
        QKClip(ddp, optim.qk_clip).attach(opt)
    return ddp, opt, opt.clip_grad_norm_, implementation


def newton_schulz_of(ddp: DataParallel, cfg: TrainConfig) -> NewtonSchulz:
    """How `muon` runs Newton-Schulz: `optim.newton_schulz`, or for `auto` the resumed run's
    choice (read from its checkpoint by rank 0) or else the machine's (`newton_schulz.choose`),
    with one step timed on the matrices this rank owns (every rank times at once, as they will
    step; rank 0's choice and figures hold everywhere). A tensor-parallel model keeps torch's
    Muon: it orthogonalizes logical matrices."""
    optim = cfg.optim
    setting = optim.newton_schulz
    if setting == "auto" and ddp.tensor_parallel:
        setting = "torch_bf16"
    shared = dist.is_initialized() and dist.get_world_size() > 1
    resumed = None
    if setting == "auto":  # after DataParallel's collectives: --overwrite has removed old ones
        resumed = [saved_newton_schulz(cfg) if not shared or dist.get_rank() == 0 else None]
        if shared:
            dist.broadcast_object_list(resumed, src=0)
        resumed = resumed[0]
    shapes = []
    for owned in ddp.step_protocol.owned():
        if owned.route.matrix:
            shape = owned.param.shape
            shapes += [matrix_shape(shape)] * (matrix_count(shape) if len(shape) > 2 else 1)
    ns = optim.ns_coefficients, optim.ns_algorithm
    chosen = choose(setting, shapes, ddp.device, *ns, resumed=resumed)
    if setting == "auto" and shared and not chosen.resumed:
        agreed = [chosen]
        dist.broadcast_object_list(agreed, src=0)
        chosen = agreed[0]
    return chosen
