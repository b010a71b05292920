"""Building from the meta device: `DataParallelConfig(param_init=fn)`.

[Note: meta-device construction]
A model built on the meta device has shapes and no values, so a model larger than one GPU can
be described on every rank. With `param_init=fn`, `DataParallel`:
1. `materialise`: picks the device (`target_device`), gives every meta trainable param a
   placeholder there (a new Parameter, ties kept: one element expanded to the param's shape, so
   nothing the size of the model is allocated), allocates frozen params and buffers there
   (`to_empty`, FSDP2's convention);
2. builds the storage units one at a time, and in each (`fill_owned`) calls
   `fn(name, view)` for every param this rank owns a part of, on the param's view of the unit's
   full buffer, under torch's RNG seeded from the name (`seeded`), so an `fn` that draws from
   torch's global generator (`nn.init.normal_`) gives the same values at any world size and in
   any mode; fully sharded, the unit then keeps only this rank's shards (one full unit exists
   at a time beside the owned shards), and on the exchange strategy its owned matrices;
3. gathers the params, so every rank holds every owner's values (on the exchange strategy,
   after the param exchange has sent the owners' pieces to the shards holding them).
`fn` also fills every frozen param, on every rank (each holds them whole). Buffers stay
uninitialised: as with FSDP2, the model's own buffer init runs after wrapping (e.g. rotary
tables), on every rank alike.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..planning import Plan
from ._storage import StorageUnit

ParamInit = Callable[[str, torch.Tensor], None]


def target_device(module: nn.Module, group: ProcessGroup | None) -> torch.device:
    """Where a meta model is materialised: the device of its non-meta tensors if it has any,
    else the current CUDA device on NCCL, else torch's default device."""
    for t in [*module.parameters(), *module.buffers()]:
        if not t.is_meta:
            return t.device
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.get_default_device()


def materialise(module: nn.Module, device: torch.device) -> set[nn.Parameter]:
    """Replace every meta param of `module` by a Parameter on `device` (the same object for a
    tied param; a trainable one a placeholder, a frozen one allocated) and allocate its meta
    buffers there; return the placeholders."""
    new: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                if p.requires_grad:
                    data = torch.zeros((), dtype=p.dtype, device=device).expand(p.shape)
                else:
                    data = torch.empty(p.shape, dtype=p.dtype, device=device)
                new[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            m._parameters[name] = new[id(p)]
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)
    return {p for p in new.values() if p.requires_grad}


def seeded(fn: ParamInit, name: str, tensor: torch.Tensor) -> None:
    """`fn(name, tensor)` with torch's RNG seeded from `name` (and restored after)."""
    devices = [tensor.device] if tensor.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(zlib.crc32(name.encode()))
        fn(name, tensor)


def fill_frozen(module: nn.Module, fn: ParamInit) -> None:
    """Fill every frozen param (each under its first name)."""
    for name, p in module.named_parameters():
        if not p.requires_grad:
            seeded(fn, name, p.data)


def fill_owned(plan: Plan, shard_rank: int, fn: ParamInit) -> Callable[[StorageUnit], None]:
    """What fills a new storage unit: `fn` on every param this rank owns a part of."""
    owned = {p.name for buffer in plan.buffers for p, _, _ in buffer.owned(shard_rank)}

    def fill(storage: StorageUnit) -> None:
        for param, placement in storage.params:
            if placement.name in owned:
                seeded(fn, placement.name, param.data)

    return fill
