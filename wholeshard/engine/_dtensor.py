"""`DataParallel` over DTensor params (tensor parallel): what it can hold.

The buffers hold each DTensor param's local shard (`wholeshard.distributed.dtensor`); its
data-parallel peers (the ranks of the dp group, at the same tensor-parallel position) hold the
same shard.
"""

from __future__ import annotations

from ..distributed.dtensor import is_dtensor


def check_tensor_parallel(
    routes: list, mesh_dims: tuple[str, ...] | None, *, param_init: bool, fp8: bool
) -> bool:
    """Whether any trainable param is a DTensor (tensor parallel); raises (alike on every rank:
    every rank builds the same model) where `DataParallel` cannot hold one: without a mesh with
    a "tp" dim, sharded over mesh dims other than "tp", built from the meta device or gathered
    as FP8."""
    from torch.distributed.tensor import Replicate

    dtensors = [r for r in routes if is_dtensor(r.param)]
    if not dtensors:
        return False
    first = dtensors[0].name
    on_ep = [r.name for r in dtensors if "ep" in (r.param.device_mesh.mesh_dim_names or ())]
    if on_ep:
        raise ValueError(
            f"{on_ep[0]!r} is a DTensor on an 'ep' mesh dim: hold each rank's experts as plain "
            f"params (their local shard, `p.to_local()`), and wrap with the mesh's 'ep' dim "
            f"([Note: expert parallelism] in wholeshard.distributed.mesh)"
        )
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
