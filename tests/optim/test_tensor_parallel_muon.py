"""Muon on tensor-parallel matrices ([Note: tensor-parallel Muon]): a DTensor weight sharded by
`parallelize_module` is orthogonalized as its logical matrix.

Newton–Schulz alone, fed the same full matrix: "duplicated" is torch's iteration to the bit,
"distributed" within bf16 rounding. The optimizer on a ColwiseParallel / RowwiseParallel MLP at
tp 2 against one process running `torch.optim.Muon` on the unsharded model.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support import run
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.optim._muon import _zeropower_via_newtonschulz

from wholeshard.capacity.tp_traffic import traffic_bytes
from wholeshard.optim import Muon
from wholeshard.optim.normuon import QUINTIC
from wholeshard.optim.tensor_parallel import (
    distributed_newton_schulz,
    gather_full,
    own_slice,
    tp_shard,
)

MUON = dict(lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
SHAPES = [(32, 48), (48, 32)]  # wide and tall: the iterate is turned for the tall one


def _newton_schulz(shape, shard_dim: int) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    sharded = distribute_tensor(full, mesh, [Shard(shard_dim)])
    shard = tp_shard(sharded)
    want = own_slice(_zeropower_via_newtonschulz(full, QUINTIC, 5, 1e-7), shard)
    sent = []
    real = dist.all_gather, dist.all_reduce

    def counting(fn):
        def wrapped(*args, **kwargs):
            t = args[1] if fn is real[0] else args[0]
            sent.append(t.numel() * t.element_size())
            return fn(*args, **kwargs)

        return wrapped

    dist.all_gather, dist.all_reduce = counting(real[0]), counting(real[1])
    try:
        local = sharded.to_local()
        duplicated = own_slice(
            _zeropower_via_newtonschulz(gather_full(local.bfloat16(), shard), QUINTIC, 5, 1e-7),
            shard,
        )
        gathered = sum(sent)
        distributed = distributed_newton_schulz(local, shard, shape, [QUINTIC] * 5, 1.0, 1e-7)
        reduced = sum(sent) - gathered
    finally:
        dist.all_gather, dist.all_reduce = real
    return dict(
        want=want,
        duplicated=duplicated,
        distributed=distributed,
        gathered=gathered,
        reduced=reduced,
    )


@pytest.mark.parametrize("shard_dim", [0, 1])
@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_of_the_logical_matrix(shape, shard_dim: int) -> None:
    for out in run(_newton_schulz, 2, shape, shard_dim):
        assert torch.equal(out["duplicated"], out["want"])
        diff = (out["distributed"].float() - out["want"].float()).abs().max().item()
        assert diff < 0.02, diff  # bf16 rounding of the summed Grams (entries ~0.1-0.3)
        assert out["duplicated"].shape == out["distributed"].shape
        # Bytes this rank put into collectives: the model counts what it sends of them, ring.
        assert out["gathered"] == 2 * shape[0] * shape[1] // 2  # its bf16 slice
        assert traffic_bytes(shape, shard_dim, 2, "duplicated", 5) == out["gathered"]
        assert traffic_bytes(shape, shard_dim, 2, "distributed", 5) == out["reduced"]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48, bias=False), nn.GELU(), nn.Linear(48, 16, bias=False))


def _train(mode: str | None, steps: int = 3) -> dict[str, torch.Tensor]:
    """`steps` of Muon on `mlp()`: tp 2 (ColwiseParallel then RowwiseParallel) with `mode`, or
    one process with torch's Muon (`mode=None`)."""
    model = mlp()
    if mode is None:
        opt = torch.optim.Muon(model.parameters(), **MUON)
    else:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = Muon(model.parameters(), tp_mode=mode, **MUON)
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    params = {}
    for name, p in model.named_parameters():
        params[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    if mode is not None:
        params["momentum is a slice"] = torch.tensor(
            [
                tuple(opt.state[p]["momentum_buffer"].to_local().shape) == tuple(p.to_local().shape)
                for p in model.parameters()
            ]
        ).all()
    return params


@pytest.mark.parametrize("mode", ["duplicated", "distributed"])
def test_tp2_muon_steps_like_one_process(mode: str) -> None:
    ref = _train(None)
    for out in run(_train, 2, mode):
        assert bool(out.pop("momentum is a slice"))
        for name, want in ref.items():
            diff = (out[name] - want).abs().max().item()
            assert diff < 3e-3, (name, diff)  # support.TOL's fp32 atol
            print(f"{mode} {name}: max |diff| vs one process {diff:.3g}")


def test_uneven_or_double_sharding_is_refused() -> None:
    def refuse():
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        said = []
        for t in (torch.randn(5, 4), torch.randn(2, 3, 4)):
            try:
                tp_shard(distribute_tensor(t, mesh, [Shard(0)]))
            except ValueError as e:
                said.append(str(e))
        return said

    first = run(refuse, 2)[0]
    assert "equal slices" in first[0] and "2-D DTensor" in first[1]
