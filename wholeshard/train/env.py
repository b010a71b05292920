"""Where this process runs: joining (or creating, or doing without) the process group, the
device, the compute dtype and the CPU threads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..capacity.cpu import FAST_BF16, cpu_bf16_matmul
from ..distributed import collectives


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: rank, world size, device, and whether it owns the group."""

    rank: int
    world: int
    local_world: int
    device: torch.device
    owns_group: bool


class GlobalMean:
    """The mean of a scalar over the ranks, and whether any rank raised `flag` (the same answer
    on every rank: it rides on the same all-reduce). The all-reduce starts now (on a copy);
    `value()` and `flagged()` read it, once (the host waits for the device there: call the first
    once more work is queued)."""

    def __init__(self, t: torch.Tensor, env: DistEnv, flag: bool = False) -> None:
        flag_t = torch.full_like(t, float(flag))  # (a fill on the device, not a host copy)
        self.t, self.world = torch.stack([t.detach(), flag_t]), env.world
        self.work = dist.all_reduce(self.t, async_op=True) if env.world > 1 else None
        self._read: list[float] | None = None

    def _values(self) -> list[float]:
        if self._read is None:
            if self.work is not None:
                with collectives.naming("the all-reduce of the loss"):
                    self.work.wait()
            self.t[0] /= self.world
            self._read = self.t.tolist()
        return self._read

    def value(self) -> float:
        return self._values()[0]

    def flagged(self) -> bool:
        return self._values()[1] > 0


def all_ok(ok: bool, env: DistEnv) -> bool:
    """Whether `ok` holds on every rank (an all-reduce of the flags; every rank must call it)."""
    if env.world == 1:
        return ok
    flag = torch.tensor([int(ok)], device=env.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def torchrun_env() -> bool:
    """True when the environment describes a launched world (torchrun or `wholeshard.distributed
    .launch`)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def torchrun_restart_warning() -> str | None:
    """A warning when torchrun may relaunch this job (`--max-restarts`) while its processes
    share torchrun's TCP store, which keeps the previous attempt's keys (torch 2.13): a
    relaunched process may read a dead peer's address and fail to connect, or hang."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not shared or os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        return None
    return (
        "warning: torchrun shares its TCP store with this job and keeps the previous attempt's "
        "keys in it, so after a restart a process may read a dead peer's address and fail to "
        "connect or hang; run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its "
        "environment"
    )


def setup_distributed(timeout: timedelta | None = None) -> DistEnv:
    """Join the existing process group, or create one from torchrun's env (with collective
    `timeout`), or run alone."""
    owns = not dist.is_initialized() and torchrun_env()
    if owns:
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    if not dist.is_initialized():
        return DistEnv(0, 1, 1, torch.device("cpu"), False)
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return DistEnv(dist.get_rank(), world, local_world, device, owns)


def resolve_param_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype `--param-dtype` names; `auto` is bfloat16 where `device` has native bf16
    matmuls (CUDA with bf16, or AVX512-BF16/AMX CPUs), else float32."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_bf16_matmul() in FAST_BF16 else torch.float32


def set_threads(threads: int | None, env: DistEnv) -> None:
    """CPU threads per process: `threads`, or the cores divided among the local processes."""
    if env.device.type != "cpu":
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(threads or max(1, (cores or 1) // env.local_world))
