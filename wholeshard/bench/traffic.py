"""Bytes each rank sends, counted from the collectives actually issued.

`TrafficCounter` is a `TorchDispatchMode`: every collective reaches the dispatcher as a `c10d::*`
op (the Python API, DDP's C++ reducer, FSDP2) or a `_c10d_functional::*` op (DTensor), so one
mode sees them all. Bytes are not measured on the wire; each op is charged what a
bandwidth-optimal ring algorithm sends per rank for a payload of S bytes on n ranks:

| collective | bytes sent per rank |
|---|---|
| all-reduce | 2 (n-1)/n S |
| reduce-scatter (S = full input) | (n-1)/n S |
| all-gather (S = full output) | (n-1)/n S |
| broadcast, reduce | (n-1)/n S (a pipelined chain: n-1 sends of S, averaged over ranks) |
| all-to-all (S = this rank's input) | S minus this rank's own chunk |
| send | S |

Gloo picks its own algorithms, so these are the volumes an NCCL ring would move: the fair unit to
compare configurations by. The mode slows every op, so it is used on one untimed step only.

Besides the total, the counter keeps `gather_bytes`: the part sent by all-gathers (every form
above, c10d and functional) and broadcasts, classified by collective type alone
(`is_param_gather`); reduce-scatters and all-reduces (gradients) never count. The figure reads
as param-sync traffic only under an invariant: every all-gather and broadcast a configuration
issues in the counted step syncs params. It holds for the wholeshard rows (all-gathers, or the
broadcasts of the baselines' layouts in `baselines`, ping-pong included) and for `ddp_kj_muon`'s
all-gather of updated params, but not everywhere (measured with torch 2.13, 2 ranks, `--quick`):

- FSDP2 + `torch.optim.Muon`: besides FSDP2's unshard all-gathers (forward and backward), the
  Newton-Schulz matmuls on sharded DTensors all-gather inside the optimizer step: two thirds
  (gpt) to four fifths (mlp) of the figure;
- DDP (both DDP rows) broadcasts module buffers in every forward (the GPT's rotary tables:
  4096 bytes per rank on the gpt workload), and in the step after the first it broadcasts its
  rebuilt bucket indices (a few bytes, in the counted step only when warm-up is 1: `--quick`).

So `ddp_torch_muon` is not 0 on gpt, `ddp_kj_muon` carries the same few KB on top of its param
all-gather, and the FSDP2 rows overstate its param gathers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def bytes_sent(namespace: str, name: str, args: tuple, world: int, rank: int) -> int | None:
    """Modelled bytes this rank sends for one collective op (`name` without overload), or None
    when the op is not one the model covers. `args` follow the op's schema."""
    if namespace == "c10d":
        return _c10d_bytes(name.rstrip("_"), args, world, rank)
    return _functional_bytes(name, args, world, rank)


_PARAM_GATHERS = {
    "c10d": frozenset(
        {"_allgather_base", "allgather_into_tensor_coalesced", "allgather", "broadcast"}
    ),
    "functional": frozenset(
        {"all_gather_into_tensor", "all_gather_into_tensor_coalesced", "broadcast"}
    ),
}


def is_param_gather(namespace: str, name: str) -> bool:
    """Whether an op `bytes_sent` models is an all-gather or a broadcast: the collectives whose
    bytes count as param sync (`gather_bytes`, see the module note on the invariant)."""
    if namespace == "c10d":
        return name.rstrip("_") in _PARAM_GATHERS["c10d"]
    return name in _PARAM_GATHERS["functional"]


def _c10d_bytes(name: str, args: tuple, world: int, rank: int) -> int | None:
    ring = (world - 1) / world
    if name in ("allreduce", "allreduce_coalesced"):  # (tensors, group, ...)
        return round(2 * ring * _nbytes(args[0]))
    if name in ("_reduce_scatter_base", "reduce_scatter_tensor_coalesced"):  # (out, in, ...)
        return round(ring * _nbytes(args[1]))
    if name == "reduce_scatter":  # (outputs, [[chunk per rank]], ...)
        chunks = args[1][0]
        return _nbytes(chunks) - _nbytes(chunks[rank])
    if name in ("_allgather_base", "allgather_into_tensor_coalesced", "allgather"):  # (out, in)
        return round(ring * _nbytes(args[0]))
    if name in ("broadcast", "reduce"):  # (tensors, group, root, ...)
        return round(ring * _nbytes(args[0]))
    if name == "alltoall_base":  # (out, in, group, out_splits, in_splits, ...)
        return _all_to_all_bytes(args[1], args[4], world, rank)
    if name == "alltoall":  # (outputs, inputs, ...)
        return _nbytes(args[1]) - _nbytes(args[1][rank])
    if name == "send":
        return _nbytes(args[0])
    if name in ("recv", "recv_any_source"):
        return 0
    return None


def _functional_bytes(name: str, args: tuple, world: int, rank: int) -> int | None:
    if name in ("all_reduce", "all_reduce_coalesced"):  # (input(s), op, group)
        return round(2 * (world - 1) / world * _nbytes(args[0]))
    if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):  # (in, op, n, group)
        n = args[2]
        return round((n - 1) / n * _nbytes(args[0]))
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):  # (in, n, group)
        return round((args[1] - 1) * _nbytes(args[0]))
    if name == "broadcast":  # (input, src, group)
        return round((world - 1) / world * _nbytes(args[0]))
    if name == "all_to_all_single":  # (input, out_splits, in_splits, group)
        return _all_to_all_bytes(args[0], args[2], world, rank)
    return None


def _all_to_all_bytes(inp: torch.Tensor, in_splits: list[int], world: int, rank: int) -> int:
    rows = max(1, inp.shape[0]) if inp.dim() else 1
    own = in_splits[rank] if in_splits else rows // world
    return _nbytes(inp) - own * (_nbytes(inp) // rows)


class TrafficCounter(TorchDispatchMode):
    """Within the context, add up the modelled bytes this rank sends (`bytes`), and separately
    those of its all-gathers and broadcasts (`gather_bytes`, the param-sync part under the
    invariant in the module note)."""

    def __init__(self) -> None:
        super().__init__()
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.bytes = 0
        self.gather_bytes = 0
        self.unmodelled: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        from torch.distributed.tensor import DTensor

        if DTensor in types:
            return NotImplemented  # let DTensor desugar into plain collectives; we see those
        if func.namespace in _NAMESPACES:
            name = func._opname  # type: ignore[attr-defined]
            if name not in _NOT_COLLECTIVES:
                sent = bytes_sent(func.namespace, name, args, self.world, self.rank)
                if sent is None:
                    self.unmodelled.add(f"{func.namespace}::{name}")
                else:
                    self.bytes += sent
                    if is_param_gather(func.namespace, name):
                        self.gather_bytes += sent
        return func(*args, **(kwargs or {}))
