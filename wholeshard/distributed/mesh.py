"""The data-parallel group of a `DeviceMesh` (`DataParallel(module, mesh=...)`).

[Note: mesh dims]
A mesh's dims say what each is by name: `"dp"` (data parallel), or `"dp_replicate"` x
`"dp_shard"` (hybrid sharding: params sharded within each `dp_shard` group and replicated
across `dp_replicate`, the mesh form of `shard_group_size`); `"dp_shard"` alone shards across
all its ranks and `"dp_replicate"` alone replicates. `"pp"` (pipeline stages) may sit beside
them: each stage wraps its own module on its own data-parallel group; so may `"tp"`: params
the model parallelized over `mesh["tp"]` are DTensors, held as their local shards (`dtensor`),
each data-parallel group holding one tensor-parallel position. `DataParallel` works on this
rank's data-parallel ranks: its dp dims flattened in row-major order, so each `dp_shard` row
is a block of consecutive data-parallel ranks (the shard groups `shard_group_size` makes).

[Note: expert parallelism]
An `"ep"` dim splits a MoE's experts: each of its ranks holds E / ep experts (a stack whose
dim 0 is its experts, plain or a DTensor `Shard(0)` on "ep" as torchtitan lays it out, or
`experts.<i>` modules) and the model dispatches tokens to them itself. Every rank of dp x ep
holds the same dense params and sees its own batch, so the dense params' group is the
data-parallel and "ep" dims flattened; an expert's copies lie only along the data-parallel
dims (its expert-data-parallel group), which `DataParallel` reduces and gathers them over,
with a plan and buckets of their own. An expert's gradient on one rank already sums what the
ep peers' tokens contributed (the dispatch's backward brings them back), so its average
divides by dp x ep, like the dense params', not by dp. Beside a "tp" dim the dense params may
be tensor parallel and the experts are replicated over it (every tp rank runs them on the same
tokens): each tp position has its own dense and expert groups, and the model's ranks span
dp x ep x tp. Experts sliced over "tp" (expert tensor parallelism) are refused.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

DP_DIMS = ("dp", "dp_replicate", "dp_shard")
"""The data-parallel dim names, in the order a mesh must have them."""

KNOWN_DIMS = (*DP_DIMS, "pp", "tp", "ep")


class MeshGroups(NamedTuple):
    """What a mesh gives `DataParallel`."""

    group: ProcessGroup  # the data-parallel group (with "ep": dp x ep, the dense params')
    shard_group_size: int | None
    expert_group: ProcessGroup | None = None  # with "ep": the expert-data-parallel group
    expert_shard_group_size: int | None = None  # and its shard group size
    ep: int = 1  # the "ep" dim's size
    ep_rank: int = 0  # this rank's place on it


def mesh_data_parallel(
    mesh: DeviceMesh, process_group: ProcessGroup | None, shard_group_size: int | str | None
) -> MeshGroups:
    """The groups `mesh` gives, checked against the `process_group` and `shard_group_size` also
    given. Every rank raises alike on a mesh it cannot use: the checks read the whole mesh,
    which every rank holds."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {mesh!r}")
    if process_group is not None:
        raise ValueError("pass mesh= or process_group=, not both: the mesh gives the group")
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim:
        raise ValueError(
            "the mesh's dims need names saying what each is: init_device_mesh(device, shape, "
            "mesh_dim_names=('dp',)), or ('dp_replicate', 'dp_shard') ([Note: mesh dims])"
        )
    unknown = [n for n in names if n not in KNOWN_DIMS]
    if unknown:
        raise ValueError(f"mesh dims {unknown} are not among {list(KNOWN_DIMS)}")
    dp = [n for n in names if n in DP_DIMS]
    if not dp:
        raise ValueError(f"the mesh {names} has no data-parallel dim: name one 'dp'")
    if "dp" in dp and len(dp) > 1:
        raise ValueError(
            f"the mesh {names} names 'dp' and a hybrid dim: use 'dp' alone, or "
            f"('dp_replicate', 'dp_shard')"
        )
    if dp == ["dp_shard", "dp_replicate"]:
        raise ValueError("name the mesh's dims ('dp_replicate', 'dp_shard'), in that order")
    at = [names.index(n) for n in dp]
    rest = [i for i in range(mesh.ndim) if i not in at]
    groups = mesh.mesh.permute(*rest, *at).reshape(-1, math.prod(mesh.mesh.shape[i] for i in at))
    if not bool((groups.diff(dim=1) > 0).all()):
        raise ValueError(
            "the mesh's ranks must increase along its data-parallel dims (as init_device_mesh "
            f"lays them out), got {mesh.mesh.tolist()}"
        )
    sizes = {n: mesh.size(names.index(n)) for n in dp}
    k = (
        sizes["dp_shard"]
        if len(dp) == 2
        else {"dp": None, "dp_shard": None, "dp_replicate": 1}[dp[0]]
    )
    if shard_group_size not in (None, "auto") and shard_group_size != k:  # the mesh decides
        raise ValueError(
            f"shard_group_size={shard_group_size!r}, but the mesh's dims {sizes} say "
            f"{k}: pass one or the other"
        )
    if "ep" in names:
        return _expert_parallel(mesh, names, dp, k)
    group = mesh.get_group(dp[0]) if len(dp) == 1 else mesh[tuple(dp)]._flatten().get_group()
    return MeshGroups(group, k)


def _expert_parallel(
    mesh: DeviceMesh, names: tuple[str, ...], dp: list[str], k: int | None
) -> MeshGroups:
    """The dense group (the dp dims and "ep" flattened) and the expert-data-parallel one (the
    dp dims), with their shard group sizes: hybrid, dense params are sharded over dp_shard x ep
    and experts over dp_shard, both replicated over dp_replicate ([Note: expert parallelism])."""
    before = "dp_replicate" in dp and names.index("ep") < names.index("dp_replicate")
    if dp == ["dp_replicate"] or before:
        raise ValueError(
            f"the mesh {names}: with 'ep' name 'dp', 'dp_shard' or ('dp_replicate', "
            f"'dp_shard'), and put 'ep' after 'dp_replicate' (dense params are sharded over "
            f"dp_shard x ep)"
        )
    ep = names.index("ep")
    dense = mesh[tuple(n for n in names if n in (*dp, "ep"))]._flatten().get_group()
    experts = mesh.get_group(dp[0]) if len(dp) == 1 else mesh[tuple(dp)]._flatten().get_group()
    return MeshGroups(
        dense,
        None if k is None else k * mesh.size(ep),
        experts,
        k,
        mesh.size(ep),
        mesh.get_local_rank(ep),
    )


class ModelRanks(NamedTuple):
    """The ranks that together hold one whole model (the data-parallel group: dp, or dp x ep
    with experts; and with tensor parallelism x tp),
    and this one's place among them: the ranks a checkpoint spans and the step check agrees
    over."""

    group: ProcessGroup | None
    size: int
    rank: int
    tp_rank: int  # position in the tensor-parallel group (0 without one): rank 0 writes replicas


def model_ranks(
    mesh: DeviceMesh | None, group: ProcessGroup | None, size: int, rank: int
) -> ModelRanks:
    """The data-parallel group (`group`, `size`, `rank`), or with a tensor-parallel model on
    `mesh` its data-parallel, "ep" and "tp" dims flattened: every element of a tensor-parallel
    param (and every expert) has its owner among them. Every rank of the mesh calls it."""
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return ModelRanks(group, size, rank, 0)
    dims = tuple(n for n in mesh.mesh_dim_names if n in (*DP_DIMS, "ep", "tp"))
    flat = mesh[dims]._flatten()
    return ModelRanks(
        flat.get_group(), flat.size(), flat.get_local_rank(), mesh.get_local_rank("tp")
    )
