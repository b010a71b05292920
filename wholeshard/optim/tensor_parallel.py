"""Newton–Schulz on a tensor-parallel matrix: the update of the logical (unsharded) matrix.

[Note: tensor-parallel Muon]
A weight that `torch.distributed.tensor.parallel.parallelize_module` sharded (a DTensor with
`Shard(0)`, ColwiseParallel's, or `Shard(1)`, RowwiseParallel's, on one mesh dim) holds a slice
of the matrix Muon must orthogonalize whole. Momentum is element-wise, so it stays a slice; only
Newton–Schulz needs the other slices, in one of two ways (`tp_mode`):
- "duplicated": all-gather the bf16 Newton–Schulz input across the tensor-parallel group, run
  torch's iteration on the full matrix on every rank, keep this rank's slice. The same bits as
  one process on the same input; traffic: the matrix in bf16, (tp - 1) / tp of it per rank.
- "distributed": keep the slices and all-reduce what the iteration sums across them: the
  squared Frobenius norm, then in each iteration the Gram matrix of the unsharded side (m x m,
  m the unsharded dim's length) in float32. Equal in exact arithmetic (p(X Xᵀ) X = X p(Xᵀ X));
  in bf16 within rounding. Traffic: ns_steps Gram matrices, 2 (tp - 1) / tp of each per rank;
  less than duplicated when the unsharded side is short, more when it is long
  (`capacity.tp_traffic.traffic_bytes`; `wholeshard plan --tp N` sums it over a model).
Muon's shape scaling (`adjust_lr_fn`) reads the DTensor's logical shape. Supported: a DTensor
sharded on exactly one mesh dim, on dim 0 or 1 of a 2-D param, replicated on any other dims.

[Note: replicas of tensor-parallel matrices]
Any other matrix rule (NorMuon, SOAP, one of your own) may keep state that is not element-wise
(per-row moments, Kronecker factors) and reads the whole matrix, so it cannot step a slice.
With `tp_mode="duplicated"` every tensor-parallel rank keeps a float32 replica of the logical
matrix, which the rule steps with the logical matrix's state: before each update the replica
and its gradient are all-gathered from the slices (the masters, so a load, or a hook's write
to them, is seen), every tp rank then runs the same update on the same bits, and each keeps
its own slice. The state is that of one process, the same on every tp rank: a checkpoint
writes it once (tp rank 0, whole), and it loads at any tp. Cost per matrix and step: the fp32
matrix and its gradient gathered (8 bytes x (tp - 1) / tp of its elements per rank), the
rule's work and its state tp times over.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed import collectives
from ..distributed.dtensor import is_tensor_parallel, sharding
from ..planning.specs import iterate_sharded_dim
from .gram_ns import Coefficients

TpMode = Literal["duplicated", "distributed"]
TP_MODES = ("duplicated", "distributed")


class TpShard(NamedTuple):
    """Where a 2-D DTensor's slice sits: sharded on `dim` across `group` (`size` ranks, this
    one `rank`)."""

    group: dist.ProcessGroup
    dim: int
    rank: int
    size: int


def tp_shard(t: Tensor) -> TpShard | None:
    """The shard layout of `t` if it is a DTensor sharded on one mesh dim (None if it is a plain
    tensor or replicated); raises ValueError for layouts Newton–Schulz cannot work on."""
    from torch.distributed.tensor import Shard

    sharded = sharding(t)
    if not sharded:
        return None
    if len(sharded) > 1 or not isinstance(sharded[0][1], Shard) or t.ndim != 2:
        raise ValueError(
            f"tensor-parallel Muon needs a 2-D DTensor sharded on one mesh dim (Shard(0) or "
            f"Shard(1)), replicated on the others; got shape {tuple(t.shape)} with placements "
            f"{t.placements}"
        )
    mesh_dim, placement = sharded[0]
    mesh, dim = t.device_mesh, placement.dim % 2
    size = mesh.size(mesh_dim)
    if t.shape[dim] % size:
        raise ValueError(
            f"tensor-parallel Muon needs equal slices: dim {dim} of shape {tuple(t.shape)} does "
            f"not divide by the {size} ranks it is sharded over"
        )
    return TpShard(mesh.get_group(mesh_dim), dim, mesh.get_local_rank(mesh_dim), size)


def tp_slices(routes: list) -> tuple[dist.ProcessGroup | None, set[str]]:
    """(the tensor-parallel group, the names of the params sliced over it), from the routes'
    DTensor params of any rank (a ColwiseParallel bias is 1-D); (None, empty) without any."""
    from torch.distributed.tensor import Shard

    group, names = None, set()
    for r in routes:
        for mesh_dim, placement in sharding(r.param) if is_tensor_parallel(r.param) else ():
            if isinstance(placement, Shard):
                group = r.param.device_mesh.get_group(mesh_dim)
                names.add(r.name)
    return group, names


def combined_norms(
    norms: list[Tensor],
    sliced: list[bool],
    norm_type: float,
    tp_group: dist.ProcessGroup | None,
    device: torch.device,
) -> Tensor:
    """This rank's part of a global norm from its pieces' `norms`: the sum of their
    `norm_type`-th powers (the max, for inf), float32, shape (1,); the pieces of params sliced
    by tensor parallelism (`sliced`) first combined over `tp_group`, so each element counts once
    across the tp ranks and a replicated param once, not tp times."""
    inf = math.isinf(norm_type)

    def combined(ns: list[Tensor]) -> Tensor:
        t = torch.stack(ns) if ns else torch.zeros(1, device=device)
        return (t.max() if inf else t.pow(norm_type).sum()).float().reshape(1)

    local = combined([n for n, s in zip(norms, sliced, strict=True) if not s])
    if tp_group is None:
        return local
    parts = combined([n for n, s in zip(norms, sliced, strict=True) if s])
    collectives.all_reduce(parts, tp_group, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    return torch.maximum(local, parts) if inf else local + parts


def check_tp_mode(mode: str) -> TpMode:
    if mode not in TP_MODES:
        raise ValueError(f"tp_mode must be one of {TP_MODES}, got {mode!r}")
    return mode  # type: ignore[return-value]


def gather_full(local: Tensor, shard: TpShard) -> Tensor:
    """The full matrix from every rank's slice of it ("duplicated")."""
    parts = [torch.empty_like(local) for _ in range(shard.size)]
    dist.all_gather(parts, local.contiguous(), group=shard.group)
    return torch.cat(parts, dim=shard.dim)


def own_slice(full: Tensor, shard: TpShard) -> Tensor:
    """This rank's slice of `full`, contiguous."""
    return full.chunk(shard.size, shard.dim)[shard.rank].contiguous()


def distributed_newton_schulz(
    local: Tensor,
    shard: TpShard,
    full_shape: tuple[int, int],
    schedule: list[Coefficients],
    safety: float,
    eps: float,
) -> Tensor:
    """This rank's slice (bf16) of torch's Newton–Schulz iteration on the full matrix, from the
    slices alone ("distributed", [Note: tensor-parallel Muon])."""
    tall = full_shape[0] > full_shape[1]
    x = local.bfloat16()
    x = x.T if tall else x
    sq = x.float().pow(2).sum().reshape(1)
    dist.all_reduce(sq, group=shard.group)
    norm = sq.sqrt().to(torch.bfloat16)[0]
    x = x / (norm if safety == 1.0 else norm * safety).clamp(min=eps)
    for a, b, c in schedule:
        if iterate_sharded_dim(full_shape, shard.dim) == 1:  # columns split: x xᵀ sums the slices'
            gram = _summed(x @ x.T, shard)
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        else:  # rows split: the same polynomial from the right, with xᵀ x
            gram = _summed(x.T @ x, shard)
            x = torch.addmm(x, x, torch.addmm(gram, gram, gram, beta=b, alpha=c), beta=a)
    return (x.T if tall else x).contiguous()


def _summed(partial: Tensor, shard: TpShard) -> Tensor:
    """`partial` summed over the group in float32, back in bf16."""
    total = partial.float()
    dist.all_reduce(total, group=shard.group)
    return total.to(torch.bfloat16)


def replicate(pieces: list) -> None:
    """Give each of `pieces` (`OwnedPiece`s) that is a slice of a tensor-parallel matrix a
    replica of the logical matrix for the rule to step ([Note: replicas of tensor-parallel
    matrices])."""
    for piece in pieces:
        if piece.tp_param is None:
            continue
        if piece.rows is not None:
            raise NotImplementedError(
                f"{piece.name}: row blocks (ns_split) of a tensor-parallel matrix with a rule "
                f"other than Muon are not supported yet"
            )
        piece.replica = piece.master.new_zeros(piece.tp_param.shape)


@contextlib.contextmanager
def replicas_stepped(pieces: list) -> Iterator[None]:
    """Around the rule's step of `pieces`: each replica among them and its gradient gathered
    from the slices before, each replica's slice written back to its master after (collectives
    over each matrix's tensor-parallel group: every tp rank steps the same pieces)."""
    replicated = [piece for piece in pieces if piece.replica is not None]
    for piece in replicated:
        shard = tp_shard(piece.tp_param)
        piece.replica.copy_(gather_full(piece.master, shard))
        piece.replica.grad = gather_full(piece.master.grad, shard)
    yield
    for piece in replicated:
        piece.master.copy_(own_slice(piece.replica, tp_shard(piece.tp_param)))
