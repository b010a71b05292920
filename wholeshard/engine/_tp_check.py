"""`DataParallel` over DTensor params (tensor parallel): what it can hold.

The buffers hold each DTensor param's local shard (`wholeshard.distributed.dtensor`); its
data-parallel peers (the ranks of the dp group, at the same tensor-parallel position) hold the
same shard.
"""

from __future__ import annotations

from ..distributed.dtensor import is_dtensor, on_experts_dim


def check_tensor_parallel(
    routes: list, mesh_dims: tuple[str, ...] | None, *, param_init: bool, fp8: bool
) -> bool:
    """Whether any trainable param is a DTensor of tensor parallelism; raises (alike on every
    rank: every rank builds the same model) where `DataParallel` cannot hold one: without a mesh
    with a "tp" dim, sharded over mesh dims other than "tp", built from the meta device or
    gathered as FP8. DTensors on an "ep" dim (experts) must be sharded on dim 0 over it alone."""
    from torch.distributed.tensor import Replicate, Shard

    dtensors = [r for r in routes if is_dtensor(r.param)]
    for r in (r for r in dtensors if on_experts_dim(r.param)):
        names = r.param.device_mesh.mesh_dim_names
        wanted = tuple(Shard(0) if n == "ep" else Replicate() for n in names)
        if mesh_dims is None or "ep" not in mesh_dims or tuple(r.param.placements) != wanted:
            raise ValueError(
                f"{r.name!r} is a DTensor on mesh dims {names} with placements "
                f"{tuple(r.param.placements)}: experts split over 'ep' are Shard(0) on it (and "
                f"Replicate on other dims), wrapped with DataParallel(module, mesh=mesh) whose "
                f"mesh has that 'ep' dim ([Note: expert parallelism] in "
                f"wholeshard.distributed.mesh)"
            )
    dtensors = [r for r in dtensors if not on_experts_dim(r.param)]
    if not dtensors:
        return False
    first = dtensors[0].name
    if mesh_dims is None or "tp" not in mesh_dims:
        raise ValueError(
            f"{first!r} is a DTensor (tensor parallel): wrap with DataParallel(module, "
            f"mesh=mesh) where mesh has a 'tp' dim beside the data-parallel ones, e.g. "
            f"init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))"
        )
    for r in dtensors:
        names = r.param.device_mesh.mesh_dim_names or ()
        for name, placement in zip(names, r.param.placements, strict=True):
            if name != "tp" and not isinstance(placement, Replicate):
                raise ValueError(
                    f"{r.name!r} is sharded over mesh dim {name!r}: DataParallel shards the "
                    f"data-parallel dims itself; parallelize the model over mesh['tp'] only"
                )
    if param_init or fp8:
        what = "param_init (meta-device construction)" if param_init else "fp8_param_gather"
        raise NotImplementedError(f"{what} with tensor-parallel (DTensor) params")
    return True
