"""The muon path of the train job (`--optimizer muon`, the default): the model wrapped in
wholeshard's `DataParallel` and stepped by `LayerwiseOptimizer`, the hidden matrices by the rule
`optim.matrix_optimizer` names (`wholeshard.optim.rules`), the rest by AdamW; with
`optim.qk_clip`, MuonClip after every update (`wholeshard.optim.QKClip`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..engine.data_parallel import DataParallel
from ..optim import LayerwiseOptimizer, QKClip
from ..optim.rules import matrix_kwargs, matrix_rule
from .baseline import ADAMW_BETAS
from .config import TrainConfig


def build_wholeshard(
    model: nn.Module, cfg: TrainConfig, param_dtype: torch.dtype, mesh: Any = None
) -> tuple[DataParallel, LayerwiseOptimizer, Callable[[float], torch.Tensor]]:
    """(the module to call, the optimizer, the gradient clipper) of `model` as `cfg` says, on
    `mesh` (a ("dp", "tp") `DeviceMesh` for a tensor-parallel model; None: the default group).
    The layout evens out the rule's own work per matrix (`DataParallel.balance_for`, which the
    optimizer calls)."""
    optim = cfg.optim
    ns = optim.ns_coefficients, optim.ns_algorithm
    rule = matrix_rule(optim.matrix_optimizer, *ns)
    parallel = dataclasses.replace(
        cfg.parallel,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        fp8_param_gather=cfg.model.fp8 is not None,
    )
    ddp = DataParallel(model, parallel, mesh=mesh)
    lr, weight_decay = cfg.peak_lr, optim.weight_decay
    opt = LayerwiseOptimizer(
        ddp,
        matrix_optimizer=rule,
        matrix=matrix_kwargs(optim.matrix_optimizer, lr, weight_decay, *ns),
        adamw=dict(lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay),
        nonfinite=optim.on_nonfinite,
    )
    if optim.qk_clip is not None:
        QKClip(ddp, optim.qk_clip).attach(opt)
    return ddp, opt, opt.clip_grad_norm_
