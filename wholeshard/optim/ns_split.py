"""Row blocks that Newton–Schulz treats as separate matrices (`LayerwiseOptimizer(ns_split=)`).

[Note: row blocks]
`ns_split(name, param) -> list[int] | None` gives, for a matrix-routed param, the sizes of the row
blocks of its (out, in) matrix (of each matrix, for a stack) that the matrix optimizer steps as
separate matrices: Newton–Schulz, Muon's shape scaling (`adjust_lr_fn`) and any per-matrix
state see each block alone, exactly as if the model had one projection per block. None (or one
block of every row) leaves the param whole. The layout does not change: the fused tensor stays
whole in its owner's shard, and the owner steps its blocks. `param` is a meta tensor with the
param's shape and dtype as Muon sees it, (..., out, in): a weight stored (in, out)
(transformers' `Conv1D`) comes transposed, fully sharded params, released between steps, still
have their shape, and a tensor-parallel (DTensor) param has its logical shape: each rank steps
the blocks within its slice of rows (ColwiseParallel; a block may not straddle two slices), or
with the columns sliced (RowwiseParallel) every block, a tensor-parallel matrix of its own.

The blocks are fixed when the optimizer is built, on every rank alike, and checked there: sizes
must be positive ints summing to the matrix's rows, else every rank raises naming the param.
A checkpoint stores element-wise state (momentum) as usual, so it loads with or without the
same split; state with one value per block (NorMuon's per-row second moment, SOAP's factors)
is stored per block and loads only under the same split.

Fused q/k/v rows come in model-specific orders (`split_qkv`'s `layout`):
- "qkv": every query row, then every key row, then every value row: GPT-2's `c_attn`, Phi-3's
  `qkv_proj`, MPT's `Wqkv`, `nn.MultiheadAttention`'s `in_proj_weight`. Blocks: q, k, v.
- "grouped": rows grouped by key/value head, each group its query heads' rows, then its key
  head, then its value head: GPT-NeoX's `query_key_value` (one query head per group), Falcon's.
  The query rows of the model are not one contiguous block there, so the blocks are each
  group's queries, key and value (with one head per group: per-head q, k and v).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from typing import Literal

import torch

from ..planning.routing import Route

NsSplit = Callable[[str, torch.Tensor], "Sequence[int] | None"]

FUSED_QKV_NAMES = ("c_attn", "qkv_proj", "query_key_value", "Wqkv", "qkv", "in_proj_weight")
"""Name components of fused q/k/v weights `split_qkv` splits by default."""

ATTENTION_INPUT_NAMES = (
    *FUSED_QKV_NAMES,
    *("q_proj", "k_proj", "v_proj", "q", "k", "v", "query", "key", "value", "wq", "wk", "wv"),
)
"""Name components of attention input projections `split_heads` splits by default."""


def split_qkv(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    layout: Literal["qkv", "grouped"] | None = None,
    names: Iterable[str] = FUSED_QKV_NAMES,
) -> NsSplit:
    """An `ns_split` stepping a fused q/k/v weight as its query, key and value matrices.

    It applies to Muon params with a name component in `names` (a module's name, or the param's
    own: `in_proj_weight`), which must then have (num_heads + 2 * num_kv_heads) * head_dim rows.
    `layout` is the row order ([Note: row blocks]); None picks "grouped" for GPT-NeoX's
    `query_key_value` and "qkv" otherwise.
    """
    _positive(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if layout not in (None, "qkv", "grouped"):
        raise ValueError(f"split_qkv's layout must be 'qkv', 'grouped' or None, got {layout!r}")
    names = frozenset(names)
    rows = (num_heads + 2 * num_kv_heads) * head_dim

    def ns_split(name: str, param: torch.Tensor) -> list[int] | None:
        components = name.split(".")
        if names.isdisjoint(components):
            return None
        if param.shape[-2] != rows:
            raise ValueError(
                f"split_qkv: {name} has {param.shape[-2]} rows (out, in orientation), not "
                f"(num_heads + 2 * num_kv_heads) * head_dim = ({num_heads} + 2 * "
                f"{num_kv_heads}) * {head_dim} = {rows}: check the head counts, or leave it "
                f"out of `names`"
            )
        if layout == "grouped" or (layout is None and "query_key_value" in components):
            queries = num_heads // num_kv_heads * head_dim
            return [queries, head_dim, head_dim] * num_kv_heads
        return [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]

    return ns_split


def split_heads(head_dim: int, *, names: Iterable[str] = ATTENTION_INPUT_NAMES) -> NsSplit:
    """An `ns_split` stepping each head's `head_dim` rows as its own matrix, for Muon params with
    a name component in `names` (by default the attention input projections: q, k, v, fused or
    not), whose rows must then be a multiple of `head_dim`."""
    _positive(head_dim=head_dim)
    names = frozenset(names)

    def ns_split(name: str, param: torch.Tensor) -> list[int] | None:
        if names.isdisjoint(name.split(".")):
            return None
        rows = param.shape[-2]
        if rows % head_dim:
            raise ValueError(
                f"split_heads: {name} has {rows} rows (out, in orientation), not a multiple of "
                f"head_dim {head_dim}"
            )
        return [head_dim] * (rows // head_dim)

    return ns_split


def row_blocks(routes: Iterable[Route], ns_split: NsSplit | None) -> dict[str, tuple[int, ...]]:
    """Each split Muon param's row blocks as boundaries `(0, b1, ..., rows)`, checked; params
    left whole are absent. Every rank computes the same from the same routes."""
    if ns_split is None:
        return {}
    if not callable(ns_split):
        raise TypeError(f"ns_split must be a function (name, param) -> sizes, got {ns_split!r}")
    blocks = {}
    for route in routes:
        if not route.matrix:
            continue
        logical = route.logical_shape  # a tensor-parallel matrix's whole (`pieces.pieces_of`)
        shape = (*logical[:-2], *logical[-2:][:: -1 if route.transposed else 1])
        sizes = ns_split(route.name, torch.empty(shape, dtype=route.param.dtype, device="meta"))
        if sizes is None:
            continue
        sizes = list(sizes)
        if not all(isinstance(s, int) and s > 0 for s in sizes) or sum(sizes) != shape[-2]:
            raise ValueError(
                f"ns_split gave {route.name}: {_shown(sizes)}: the row blocks of a Muon param "
                f"must be positive ints summing to its {shape[-2]} rows (shape {shape} as Muon "
                f"sees it, (..., out, in))"
            )
        if len(sizes) > 1:
            bounds = [0, *accumulate(sizes)]
            _check_slices(route, bounds)
            blocks[route.name] = tuple(bounds)
    return blocks


def _check_slices(route: Route, bounds: list[int]) -> None:
    """A tensor-parallel matrix's blocks must lie each within one rank's slice of rows
    (ColwiseParallel), so that each rank steps its own blocks alone; raised on every rank. (With
    its columns sliced, RowwiseParallel, each block is a tensor-parallel matrix of its own.)"""
    rows, local = route.logical_shape[0], route.shape[0]
    if local == rows:  # all rows here
        return
    edges = set(range(0, rows + 1, local))  # where one rank's slice ends and the next begins
    if route.shape[1:] != route.logical_shape[1:] or not edges <= set(bounds):
        raise NotImplementedError(
            f"ns_split on {route.name}: row blocks of a tensor-parallel matrix must each lie "
            f"within one rank's slice of rows (ColwiseParallel: slices of {local} of its {rows} "
            f"rows), got bounds {_shown(bounds)}"
        )


def _shown(sizes: Sequence[object]) -> str:
    return "[" + ", ".join(map(str, sizes[:8])) + (", ...]" if len(sizes) > 8 else "]")


def _positive(**values: int) -> None:
    for key, value in values.items():
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{key} must be a positive int, got {value!r}")
