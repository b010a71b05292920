"""Matrix rules in the bench: which optimizer steps the matrix-routed matrices (`Rule`, in
`configs`: no torch there, for the CLI), and the peer every rule is compared with, `ddp_kj_rule`:
torch DDP with the rule run KJ-style. A rule replaces the class stepping the owned matrices of
every wholeshard configuration and of `ddp_kj_rule`; the other peers are rule-independent.

`ddp_kj_rule` generalises `ddp_kj_muon`'s ownership (`muon.MuonWithAuxAdam`) to any rule whose
update of a matrix reads only that matrix, its gradient and its state: DDP all-reduces every
gradient; the matrices sorted by size, largest first, are owned round-robin (rank r steps every
world-th from r) by the rule's class; AdamW steps the other params on every rank; then every
matrix is broadcast from its owner.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .configs import ADAMW_KW, DEFAULT_RULE, KJ_RULE, MUON_KW, Rule, rule_sensitive

__all__ = ["DEFAULT_RULE", "KJ_RULE", "Rule", "rule_sensitive", "rule_optimizer", "RoundRobin"]

MATRIX_KWARGS: dict[str, dict[str, Any]] = {
    "batched": {},
    "batched_fp32": {"matmul_dtype": torch.float32},
}
"""`BatchedMuon`'s keywords per `configs.MATRIX_OPTIMIZERS` entry (torch's: none)."""


def rule_optimizer(
    rule: Rule, matrix: str = "torch"
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The class and keywords stepping matrices under `rule` for a configuration whose
    `matrix_optimizer` is `matrix`; the default rule gives the configuration's own class
    (torch's Muon, `BatchedMuon`). ValueError for a combination that does not exist."""
    from ..optim import BatchedMuon
    from ..optim.rules import matrix_rule, ns_kwargs

    muon_kw = dict(MUON_KW, adjust_lr_fn="original")
    if matrix != "torch":
        if rule.optimizer != "muon" or rule.ns_coefficients != "quintic":
            raise ValueError(f"{matrix}: BatchedMuon steps only Muon, with the fixed quintic")
        ns = {} if rule.ns_algorithm == "standard" else {"ns_algorithm": rule.ns_algorithm}
        return BatchedMuon, dict(muon_kw, **MATRIX_KWARGS[matrix], **ns)
    cls = matrix_rule(rule.optimizer, rule.ns_coefficients, rule.ns_algorithm)  # ImportError:
    ns = ns_kwargs(rule.optimizer, rule.ns_coefficients, rule.ns_algorithm)  # not installed
    if rule.optimizer == "muon":
        return cls, dict(muon_kw, **ns)
    if rule.optimizer == "normuon":
        return cls, dict(MUON_KW, **ns)
    return cls, dict(ADAMW_KW, betas=(0.95, 0.95))  # SOAP: AdamW's lr, its own betas


def rule_unavailable(rule: Rule, matrix: str = "torch") -> str | None:
    """Why `rule` cannot step a configuration with `matrix_optimizer` `matrix`, or None."""
    try:
        rule_optimizer(rule, matrix)
    except (ValueError, ImportError) as e:
        return f"rule {rule.label or 'muon'}: {type(e).__name__}: {e}"
    return None


class RoundRobin:
    """The optimizer of `ddp_kj_rule` on one rank (module note): `optimizers` step this rank's
    share, then every one of `matrices` is broadcast from its owner, index i from rank i mod
    world. `state` is the share's state; `zero_grad` clears every matrix's grad."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], matrices: list[torch.Tensor]):
        self.optimizers = optimizers
        self.matrices = matrices

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    @torch.no_grad()
    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()
        world = dist.get_world_size()
        works = [dist.broadcast(p, i % world, async_op=True) for i, p in enumerate(self.matrices)]
        for work in works:
            work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)
        for p in self.matrices:
            p.grad = None


def by_size(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """`params` largest first, by `size()` as `muon.MuonWithAuxAdam` sorts them (stable)."""
    return sorted(params, key=lambda p: p.size(), reverse=True)
