"""The matrix rules by name: what `wholeshard train --matrix-optimizer` and `wholeshard bench`
choose from, and the keyword arguments the train job gives each.

`LayerwiseOptimizer(ddp, matrix=matrix_kwargs(...), matrix_optimizer=matrix_rule(...))` runs a
rule distributed (`matrix_rule.MatrixRule`). `muon` with the fixed quintic is `torch.optim.Muon`
itself; with another Newton-Schulz schedule or algorithm, `wholeshard.optim.Muon`.
`tensor_parallel_rule`: the rule that steps tensor-parallel matrices.
"""

from __future__ import annotations

from typing import Any

import torch

from ..distributed.dtensor import is_tensor_parallel
from .normuon import QUINTIC, Muon, NorMuon
from .soap import SOAP
from .tensor_parallel import check_tp_mode

MATRIX_RULES = ("muon", "normuon", "soap")
"""The rules' names, in the order `--help` lists them."""
NS_RULES = ("muon", "normuon")
"""The rules that orthogonalize with Newton-Schulz (and so take `ns_coefficients` and
`ns_algorithm`: `wholeshard.optim.gram_ns`)."""


def matrix_rule(
    name: str, ns_coefficients: str = "quintic", ns_algorithm: str = "standard"
) -> type[torch.optim.Optimizer]:
    """The optimizer class of rule `name` (one of `MATRIX_RULES`) with these Newton-Schulz
    choices; ValueError for a combination that does not exist."""
    if name not in MATRIX_RULES:
        raise ValueError(f"matrix rule must be one of {MATRIX_RULES}, got {name!r}")
    if (ns_coefficients, ns_algorithm) != ("quintic", "standard") and name not in NS_RULES:
        raise ValueError(
            f"ns_coefficients={ns_coefficients!r}, ns_algorithm={ns_algorithm!r}: {name} does "
            f"not orthogonalize (Newton-Schulz rules: {', '.join(NS_RULES)})"
        )
    if name == "muon" and (ns_coefficients, ns_algorithm) == ("quintic", "standard"):
        return torch.optim.Muon
    return {"muon": Muon, "normuon": NorMuon, "soap": SOAP}[name]


def ns_kwargs(name: str, ns_coefficients: str, ns_algorithm: str) -> dict[str, Any]:
    """The Newton-Schulz keyword arguments of rule `name`'s class (none for torch's Muon, whose
    quintic is built in, and for rules that do not orthogonalize)."""
    if matrix_rule(name, ns_coefficients, ns_algorithm) is torch.optim.Muon or name not in NS_RULES:
        return {}
    return dict(ns_coefficients=ns_coefficients, ns_algorithm=ns_algorithm)


def matrix_kwargs(
    name: str,
    lr: float,
    weight_decay: float,
    ns_coefficients: str = "quintic",
    ns_algorithm: str = "standard",
) -> dict[str, Any]:
    """The train job's keyword arguments for rule `name`: the learning rate and decoupled weight
    decay for every rule; Muon's momentum 0.95 with its update scaled to AdamW's RMS
    (`match_rms_adamw`, so one learning rate suits both optimizers); the rules' own defaults
    otherwise; `ns_kwargs` for the Newton-Schulz rules."""
    kwargs: dict[str, Any] = dict(lr=lr, weight_decay=weight_decay)
    if name == "muon":
        kwargs.update(adjust_lr_fn="match_rms_adamw", momentum=0.95)
    return kwargs | ns_kwargs(name, ns_coefficients, ns_algorithm)


def tensor_parallel_rule(
    rule: type[torch.optim.Optimizer], kwargs: dict | None, mode: str, routes: list
) -> tuple[type[torch.optim.Optimizer], dict, bool]:
    """The matrix rule `LayerwiseOptimizer` steps with, its keyword arguments, and whether it
    steps replicas of tensor-parallel matrices: as given (no replicas) unless some matrix-routed
    param is a DTensor (tensor parallel). Then torch's Muon becomes `wholeshard.optim.Muon`
    (torch's maths and state, orthogonalizing logical matrices in `tp_mode`); any other rule
    steps a replica of each logical matrix on every tensor-parallel rank ([Note: replicas of
    tensor-parallel matrices] in `optim.tensor_parallel`), "duplicated" only."""
    mode = check_tp_mode(mode)
    kwargs = dict(kwargs or {})
    if not any(r.matrix and is_tensor_parallel(r.param) for r in routes):
        return rule, kwargs, False
    if rule is torch.optim.Muon:  # the same maths; its hyperparameters stay torch's
        rule, kwargs = Muon, {"ns_coefficients": QUINTIC, **kwargs}
    if isinstance(rule, type) and issubclass(rule, Muon):
        return rule, {**kwargs, "tp_mode": mode}, False
    if mode != "duplicated":
        raise NotImplementedError(
            f"tp_mode={mode!r} with {getattr(rule, '__name__', rule)}: only Muon splits its "
            f"work over tensor-parallel slices; other rules step each logical matrix whole on "
            f"every tensor-parallel rank (tp_mode='duplicated')"
        )
    return rule, kwargs, True
