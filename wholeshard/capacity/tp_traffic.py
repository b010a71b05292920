"""Plans of a tensor-parallel model from shapes: each rank's slices, and what Muon on the
logical matrices costs in traffic (`wholeshard plan --tp N`).

[Note: tensor-parallel shapes]
With tensor parallelism (TP) each rank holds a slice of every split matrix, so its buffers are
planned from the slices (`DataParallel` does the same with DTensor params: `Route.shape` is the
local shape). From names alone, the split is Megatron's: a 2-D Muon matrix whose module is an
output projection (`ROWWISE`: o_proj, down_proj, c_proj, ...) is split on its input dim
(`RowwiseParallel`, Shard(1)), every other 2-D Muon matrix on its output dim
(`ColwiseParallel`, Shard(0)); other params (embeddings, norms, expert stacks) are replicated.
Newton–Schulz then sees the logical matrix ([Note: tensor-parallel Muon] in
`wholeshard.optim.tensor_parallel`), at the traffic `traffic_bytes` counts.
"""

from __future__ import annotations

import dataclasses

from ..planning.specs import ParamSpec, iterate_sharded_dim

ROWWISE = frozenset(
    {"o_proj", "down_proj", "o", "down", "c_proj", "out_proj", "wo", "w2", "fc2", "dense_4h_to_h"}
)
"""Module names of output projections, split on their input dim (RowwiseParallel)."""

TP_MODES = ("duplicated", "distributed")


def shard_dim(spec: ParamSpec) -> int | None:
    """The dim a 2-D Muon matrix is split on ([Note: tensor-parallel shapes]), else None."""
    if not spec.matrix or len(spec.shape) != 2:
        return None
    parts = spec.name.split(".")
    return 1 if len(parts) > 1 and parts[-2] in ROWWISE else 0


def local_specs(specs: list[ParamSpec], tp: int) -> list[ParamSpec]:
    """Each rank's slices of `specs` split over `tp` ranks; ValueError naming a matrix whose
    split dim does not divide."""
    out = []
    for spec in specs:
        dim = shard_dim(spec)
        if dim is None or tp == 1:
            out.append(spec)
            continue
        if spec.shape[dim] % tp:
            raise ValueError(
                f"{spec.name} {spec.shape}: dim {dim} does not split evenly over tp={tp} ranks"
            )
        shape = tuple(n // tp if d == dim else n for d, n in enumerate(spec.shape))
        out.append(dataclasses.replace(spec, shape=shape))
    return out


def traffic_bytes(shape: tuple[int, ...], shard_dim: int, tp: int, mode: str, ns_steps: int) -> int:
    """Bytes one rank sends per step for Newton–Schulz on one matrix of logical `shape` split on
    `shard_dim` over `tp` ranks, ring collectives: an all-gather sends (tp - 1) / tp of its
    result, an all-reduce twice that. "duplicated": the bf16 matrix gathered; "distributed":
    `ns_steps` float32 Gram matrices of the side the iterate keeps whole, and the norm."""
    if tp == 1:
        return 0
    rows, cols = shape
    if mode == "duplicated":
        return 2 * rows * cols * (tp - 1) // tp
    short, long = sorted(shape)
    side = short if iterate_sharded_dim(shape, shard_dim) == 1 else long
    return (ns_steps * 4 * side * side + 4) * 2 * (tp - 1) // tp


def ns_traffic(specs: list[ParamSpec], tp: int, mode: str, ns_steps: int = 5) -> int:
    """One rank's Newton–Schulz bytes per step over every split matrix of `specs` (logical)."""
    total = 0
    for spec in specs:
        dim = shard_dim(spec)
        if dim is not None:
            total += traffic_bytes(spec.shape, dim, tp, mode, ns_steps)
    return total
