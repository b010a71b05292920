"""The one decision of which optimizer updates each parameter: Muon or AdamW.

The plan, DataParallel and LayerwiseOptimizer all read the routes computed here, so they can
never disagree about a parameter. torch is imported when a module is routed, not before.

[Note: the routing rule]
The field's rule (KellerJordan/Muon, Moonlight, Megatron, torchtitan, dion): Muon updates the
weights of hidden layers with >= 2 dims, AdamW everything else. The module class does not
matter: `nn.Linear`, transformers' `Conv1D`, a bare 2-D `nn.Parameter` (an MoE router) and a
3-D fused expert stack (E, out, in) all go to Muon. `route_params` sends a param to AdamW when:
- it has fewer than 2 dims (norms, biases, scalars);
- it is held by (or tied to) an `nn.Embedding` / `nn.EmbeddingBag`, or it is a table a model
  indexes itself, told by name: its own name or its module's contains "embed" or is one of
  `emb`, `wte`, `wpe`, `tok_emb`, `pos_emb` (`self.tok_embeddings = nn.Parameter(...)`, a
  custom `Embed` module's `weight`);
- it belongs to the output head: the module `model.get_output_embeddings()` returns when the
  model has that method and it returns a module (transformers' convention); otherwise any module
  whose name's last component is `lm_head`, `output`, `head` or `classifier`. A head tied to an
  embedding is AdamW by the rule above, whatever it is called;
- it is registered on the root module itself (a learned position table, a class token): those
  are not weights of a hidden layer (a model wrapped by `torch.compile` counts its original
  module as the root);
- it is the kernel of a torch convolution (`nn.Conv1d/2d/3d`, ...): (out, in, *kernel) is not a
  stack of (out, in) matrices, which is how Muon treats params with more than 2 dims.
A param with more than 2 dims routed to Muon is a stack of (out, in) matrices over its leading
dims, each orthogonalized on its own. `Route.transposed` marks weights stored (in, out)
(transformers' `Conv1D`), so the optimizer can give Muon's shape-dependent scaling the (out, in)
shape. `matrix_params(name, param)` replaces the matrix/AdamW decision (not `transposed`).

Shapes files and presets carry no modules: they state each param's route (`ParamSpec.matrix`)
as this rule decides it; nothing guesses a route from names alone.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .specs import matrix_count

if TYPE_CHECKING:
    from torch import nn

MatrixParams = Callable[[str, "nn.Parameter"], bool]

HEAD_NAMES = frozenset({"lm_head", "output", "head", "classifier"})
"""Last name components that make a module the output head (when the model does not say)."""

_EMBEDDING_COMPONENTS = frozenset({"emb", "wte", "wpe", "tok_emb", "pos_emb"})
_COMPILE_WRAPPER = "_orig_mod"  # torch.compile(m) registers m under this name


@dataclass(frozen=True)
class Route:
    """One trainable parameter, under its first registered name. `shape` is the shape the
    buffers hold: the param's as built (it stays valid while a fully sharded wrapper has the
    param released), or for a DTensor param (tensor parallel) its local shard's;
    `logical_shape` is the param's own (a DTensor's global shape)."""

    name: str
    param: nn.Parameter
    matrix: bool
    tied: bool  # reachable under more than one name (shared between modules)
    transposed: bool = False  # stored (in, out), e.g. transformers' Conv1D
    shape: tuple[int, ...] = field(init=False)
    logical_shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        local = getattr(self.param, "_local_tensor", self.param)  # a DTensor's shard
        object.__setattr__(self, "shape", tuple(local.shape))
        object.__setattr__(self, "logical_shape", tuple(self.param.shape))


def route_params(
    module: nn.Module, matrix_params: MatrixParams | None = None, *, require_matrix: bool = True
) -> list[Route]:
    """Routes for every `requires_grad` parameter of `module`, in registration order, by
    [Note: the routing rule] (`matrix_params(name, param)` replaces its matrix/AdamW decision).
    Raises ValueError if a Muon param has fewer than 2 dims, or (`require_matrix`) if nothing
    goes to Muon."""
    routes = _route(module, matrix_params)
    _validate(routes, require_matrix)
    return routes


def _route(module: nn.Module, matrix_params: MatrixParams | None) -> list[Route]:
    from torch import nn

    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((mod, attr))
    aliases = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    roots = _roots(module)
    heads = _head_modules(roots[-1])
    last_name = {id(m): name.rsplit(".", 1)[-1] for name, m in module.named_modules()}

    routes = []
    for fqn, p in module.named_parameters():
        if not p.requires_grad:
            continue
        name = clean_name(fqn)
        held = holders[id(p)]
        if matrix_params is not None:
            muon = bool(matrix_params(name, p))
        else:
            muon = p.ndim >= 2 and not any(
                isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                or _embedding_name(last_name.get(id(m), ""), a)
                or id(m) in heads
                or any(m is r for r in roots)
                or isinstance(m, nn.modules.conv._ConvNd)
                for m, a in held
            )
        transposed = any(type(m).__name__ == "Conv1D" and a == "weight" for m, a in held)
        routes.append(
            Route(name=name, param=p, matrix=muon, tied=aliases[id(p)] > 1, transposed=transposed)
        )
    return routes


def clean_name(fqn: str) -> str:
    """`fqn` without the `_orig_mod.` components `torch.compile(m)` adds, so a compiled model's
    routes, optimizer state and checkpoints use the model's own names."""
    return ".".join(part for part in fqn.split(".") if part != _COMPILE_WRAPPER)


def _embedding_name(*parts: str) -> bool:
    """Whether one of the name components says "embedding" (see the module note)."""
    return any("embed" in p or p in _EMBEDDING_COMPONENTS for p in map(str.lower, parts))


def routing_table(routes: nn.Module | Sequence[Route]) -> str:
    """A readable table of every route (name, shape, optimizer, markers), for errors and logs.
    `routes`: a list of `Route`, or a module, routed by the default rule first (without
    `route_params`' checks, so the table of a model that routes nothing to Muon shows), its
    frozen params listed too, as "frozen"."""
    frozen: list[tuple[str, tuple[int, ...]]] = []
    if not isinstance(routes, Sequence):  # a module
        module = routes
        routes = _route(module, None)
        frozen = [
            (clean_name(name), tuple(p.shape))
            for name, p in module.named_parameters()
            if not p.requires_grad
        ]
    width = max([40, *(len(r.name) + 1 for r in routes), *(len(n) + 1 for n, _ in frozen)])
    lines = [f"  {'param':<{width}} {'shape':<18} optimizer"]
    for r in routes:
        shape = _shape_text(r.shape)
        marks = []
        if r.matrix and r.param.ndim > 2:
            marks.append(f"stack of {matrix_count(r.shape)}")
        if r.tied:
            marks.append("tied")
        if r.transposed:
            marks.append("transposed: stored (in, out)")
        note = f" ({', '.join(marks)})" if marks else ""
        lines.append(f"  {r.name:<{width}} {shape:<18} {'matrix' if r.matrix else 'adamw'}{note}")
    for name, shape in frozen:
        lines.append(f"  {name:<{width}} {_shape_text(shape):<18} frozen")
    return "\n".join(lines)


def routing_summary(routes: Sequence[Route]) -> str:
    """One line: how many matrices and params go to Muon and how many tensors to AdamW (a stack
    counts as its matrices; a tied param once)."""
    muon = [r for r in routes if r.matrix]
    adamw = [r for r in routes if not r.matrix]
    matrices = sum(matrix_count(r.shape) for r in muon)
    return (
        f"routing: {_count(matrices, 'matrix', 'matrices')} "
        f"({_size(sum(math.prod(r.shape) for r in muon))} params) to Muon, "
        f"{_count(len(adamw), 'tensor', 'tensors')} "
        f"({_size(sum(math.prod(r.shape) for r in adamw))} params) to AdamW"
    )


def _roots(module: nn.Module) -> list[nn.Module]:
    """The module and, through `torch.compile` wrappers, the module it wraps (last)."""
    roots = [module]
    while type(roots[-1]).__name__ == "OptimizedModule":
        inner = roots[-1]._modules.get(_COMPILE_WRAPPER)
        if inner is None:
            break
        roots.append(inner)
    return roots


def _head_modules(root: nn.Module) -> set[int]:
    """ids of the output head's modules: `root.get_output_embeddings()` if it gives a module,
    else every module whose name's last component is in HEAD_NAMES."""
    from torch import nn

    get = getattr(root, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, nn.Module):
            return {id(head)}
    return {
        id(m)
        for name, m in root.named_modules()
        if name and name.rsplit(".", 1)[-1].lower() in HEAD_NAMES
    }


def _shape_text(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _size(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e4:
        return f"{n / 1e6:.2f}M"
    return str(n)


def _validate(routes: list[Route], require_matrix: bool = True) -> None:
    if not routes:
        raise ValueError("the module has no parameter with requires_grad=True: nothing to train")
    too_flat = [r.name for r in routes if r.matrix and r.param.ndim < 2]
    if too_flat:
        raise ValueError(
            f"Muon updates matrices (or stacks of matrices over leading dims), but these params "
            f"routed to Muon have fewer than 2 dims: {too_flat}. Return False for them from "
            f"your matrix_params predicate (they go to AdamW).\n{routing_table(routes)}"
        )
    if require_matrix and not any(r.matrix for r in routes):
        raise ValueError(
            "no parameter is routed to Muon (the default routes weights of hidden layers with "
            ">= 2 dims there: not embeddings, not the output head, not convolution kernels, not "
            "params registered on the root module); pass matrix_params=... to choose, or use "
            f"torch.optim.AdamW with torch DDP instead.\n{routing_table(routes)}"
        )
