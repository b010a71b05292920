"""The one decision of which optimizer updates each parameter: Muon or AdamW.

Layout, DataParallel and LayerwiseOptimizer all read the routes computed here, so they can
never disagree about a parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

UseMuon = Callable[[str, nn.Parameter], bool]


@dataclass(frozen=True)
class Route:
    """One trainable parameter, under its first registered name."""

    name: str
    param: nn.Parameter
    muon: bool
    tied: bool  # reachable under more than one name (shared between modules)


def route_params(module: nn.Module, use_muon: UseMuon | None = None) -> list[Route]:
    """Routes for every `requires_grad` parameter of `module`, in registration order.

    Default rule: a 2-D `weight` of an `nn.Linear` goes to Muon unless it is shared with an
    `nn.Embedding`; everything else (embeddings, norms, biases) goes to AdamW. `use_muon(name,
    param)` replaces the rule. Raises ValueError if nothing goes to Muon or a Muon param is not 2-D.
    """
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((mod, attr))
    aliases: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        aliases[id(p)] = aliases.get(id(p), 0) + 1

    routes = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if use_muon is not None:
            muon = bool(use_muon(name, p))
        else:
            held = holders[id(p)]
            muon = (
                p.ndim == 2
                and any(isinstance(m, nn.Linear) and a == "weight" for m, a in held)
                and not any(isinstance(m, nn.Embedding) for m, _ in held)
            )
        routes.append(Route(name=name, param=p, muon=muon, tied=aliases[id(p)] > 1))
    _validate(routes)
    return routes


def routing_table(routes: list[Route]) -> str:
    """A readable table of every route, for error messages and logs."""
    lines = [f"  {'param':<40} {'shape':<18} optimizer"]
    for r in routes:
        shape = "x".join(map(str, r.param.shape)) or "scalar"
        tied = " (tied)" if r.tied else ""
        lines.append(f"  {r.name:<40} {shape:<18} {'muon' if r.muon else 'adamw'}{tied}")
    return "\n".join(lines)


def _validate(routes: list[Route]) -> None:
    if not routes:
        raise ValueError("the module has no parameter with requires_grad=True: nothing to train")
    not_2d = [r.name for r in routes if r.muon and r.param.ndim != 2]
    if not_2d:
        raise ValueError(
            f"Muon orthogonalizes 2-D matrices, but these params routed to Muon are not 2-D: "
            f"{not_2d}. Route them to AdamW in your use_muon predicate.\n{routing_table(routes)}"
        )
    if not any(r.muon for r in routes):
        raise ValueError(
            "no parameter is routed to Muon (the default routes 2-D nn.Linear weights there); "
            "pass use_muon=... to choose, or use torch.optim.AdamW with torch DDP instead.\n"
            f"{routing_table(routes)}"
        )
