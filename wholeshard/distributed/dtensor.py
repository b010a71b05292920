"""DTensor params (tensor parallel) seen as the local tensors the buffers hold.

A param that `parallelize_module` made a DTensor keeps being one (its module's forward needs
it); its local tensor (`_local_tensor`) is what `DataParallel`'s buffers hold in place of a
plain param's `.data`, and its gradient's local tensor is what a bucket accumulates.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

Place = tuple[str, tuple[int, ...], "tuple[int, int] | None"]
"""A tensor's name, shape and this rank's place in it (dim, offset; None: whole here), in the
whole model: a tensor-parallel shard (`shard_place`), a stack of this rank's experts."""


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def on_experts_dim(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor on a mesh with an "ep" dim: a stack of this rank's experts (as
    torchtitan's expert parallelism lays them out), held like a plain stack, not a
    tensor-parallel matrix."""
    return is_dtensor(t) and "ep" in (t.device_mesh.mesh_dim_names or ())  # type: ignore[attr-defined]


def is_tensor_parallel(t: torch.Tensor) -> bool:
    """Whether `t` is a tensor-parallel param: a DTensor, not one of experts."""
    return is_dtensor(t) and not on_experts_dim(t)


def local(t: torch.Tensor) -> torch.Tensor:
    """`t`'s local tensor if it is a DTensor, else `t` (no autograd: a plain tensor)."""
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def set_local(param: nn.Parameter, t: torch.Tensor) -> None:
    """Make `t` the storage of `param` (of its local shard, for a DTensor)."""
    if is_dtensor(param):
        param._local_tensor = t  # type: ignore[attr-defined]
    else:
        param.data = t


def sharding(t: torch.Tensor) -> list[tuple[int, Any]]:
    """(mesh dim, placement) of every placement of a DTensor `t` that is not `Replicate` (a
    `Shard`, or a `Partial`), in mesh dim order; [] for a plain or replicated tensor. The one
    reading of placements: shard places, tensor-parallel groups and layouts ask here."""
    from torch.distributed.tensor import Replicate

    if not is_dtensor(t):
        return []
    placements = t.placements  # type: ignore[attr-defined]
    return [(i, p) for i, p in enumerate(placements) if not isinstance(p, Replicate)]


def shard_place(t: torch.Tensor) -> tuple[int, int] | None:
    """(dim, offset) of this rank's shard in a DTensor `t` sharded on one mesh dim (torch.chunk
    layout: the first shards take ceil(n / size) each), or None if `t` is not sharded."""
    from torch.distributed.tensor import Shard

    for mesh_dim, placement in sharding(t):
        if isinstance(placement, Shard):
            mesh = t.device_mesh  # type: ignore[attr-defined]
            n, size = t.shape[placement.dim], mesh.size(mesh_dim)
            chunk = -(-n // size)
            return placement.dim, min(mesh.get_local_rank(mesh_dim) * chunk, n)
    return None
