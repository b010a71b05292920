"""`DataParallel(module, mesh=...)`: a `DeviceMesh`'s data-parallel dims give the group and the
hybrid sharding ([Note: mesh dims] in `wholeshard.distributed.mesh`)."""

from __future__ import annotations

import pytest
import torch
from support import assert_bitwise_equal, data_parallel, make_model, run, wholeshard_run
from torch.distributed.device_mesh import init_device_mesh

import wholeshard

STEPS = 3


def _train_on_meshes() -> dict[str, dict]:
    """The same training with a 1-D "dp" mesh, a 2 x 2 hybrid mesh, and their group forms."""
    dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    hybrid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    runs = {
        "dp mesh": dict(mesh=dp),
        "default group": {},
        "one group": dict(shard_group_size=None),
        "hybrid mesh": dict(mesh=hybrid, reshard_after_forward=True),
        "shard_group_size=2": dict(shard_group_size=2, reshard_after_forward=True),
    }
    out = {}
    for name, ddp_kw in runs.items():
        result = wholeshard_run(STEPS, ddp_kw=ddp_kw, keep_ddp=True)
        ddp = result.pop("ddp")
        result["groups"] = (ddp.dp_size, ddp.shard_group_size)
        out[name] = result
    return out


def test_mesh_dims_train_like_their_group_forms() -> None:
    for out in run(_train_on_meshes, 4):
        assert out["dp mesh"]["groups"] == out["default group"]["groups"]  # k: the config's
        assert out["one group"]["groups"] == (4, 4)
        assert out["hybrid mesh"]["groups"] == out["shard_group_size=2"]["groups"] == (4, 2)
        assert_bitwise_equal(out["dp mesh"], out["default group"])
        assert_bitwise_equal(out["hybrid mesh"], out["shard_group_size=2"])


def _refusals() -> list[str]:
    """What each unusable mesh (or combination) raises on this rank."""
    cases = [
        lambda: dict(mesh=init_device_mesh("cpu", (2,))),
        lambda: dict(mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("data",))),
        lambda: dict(mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "ep"))),
        lambda: dict(mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))),
        lambda: dict(
            mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "dp_replicate"))
        ),
        lambda: dict(mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "dp_shard"))),
        lambda: dict(
            mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)),
            process_group=torch.distributed.group.WORLD,
        ),
        lambda: dict(
            mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_replicate", "dp_shard")),
            shard_group_size=1,
        ),
        lambda: dict(mesh="dp"),
    ]
    said = []
    for case in cases:
        try:
            data_parallel(make_model(), **case())
        except (ValueError, TypeError, NotImplementedError) as e:
            said.append(f"{type(e).__name__}: {e}")
        else:
            said.append("accepted")
    return said


def test_unusable_meshes_are_refused_on_every_rank() -> None:
    first, second = run(_refusals, 2)
    assert first == second
    expected = [
        "need names",
        "'data'] are not among",
        "'ep' dim of 2 but no trainable param is an expert's",
        "has no data-parallel dim",
        "in that order",
        "names 'dp' and a hybrid dim",
        "not both",
        "shard_group_size=1, but the mesh's dims {'dp_replicate': 1, 'dp_shard': 2} say 2",
        "TypeError: mesh must be a torch.distributed.device_mesh.DeviceMesh",
    ]
    for got, want in zip(first, expected, strict=True):
        assert want in got, (want, got)


@pytest.mark.parametrize("dims", [("dp_shard",), ("dp_replicate",)])
def test_one_hybrid_dim_alone_shards_across_all_or_replicates(dims) -> None:
    def sizes():
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=dims)
        ddp = wholeshard.DataParallel(make_model(), mesh=mesh)
        return ddp.dp_size, ddp.shard_group_size

    assert run(sizes, 2)[0] == (2, 2 if dims == ("dp_shard",) else 1)
