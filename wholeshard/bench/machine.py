"""What a bench run was measured on: the `"machine"` of its JSON and the line under its table."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

from ..capacity.cpu import SLOW_BF16, cpu_bf16_matmul

__all__ = ["SLOW_BF16", "cpu_bf16_matmul", "machine"]


def machine(
    nproc: int, forked: bool = False, device: str = "cpu", backend: str = "gloo"
) -> dict[str, Any]:
    """What the numbers were measured on (`forked`: workers run one thread, see `launch`), with
    what runs the CPU's bf16 matmuls (`cpu_bf16_matmul`); on `device="cuda"` also the GPU, its
    count and its dense bf16 peak (None if unknown)."""
    import torch  # here, not at the top: the report's formatting serves tools without torch

    from .flops import bf16_peak_tflops

    cores = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cores
    try:
        muon_version: str | None = metadata.version("muon-optimizer")
    except metadata.PackageNotFoundError:
        muon_version = None
    info = {
        "cpu": _cpu_name(),
        "cores": cores,
        "usable_cores": usable,
        "threads_per_rank": 1 if forked else max(1, cores // nproc),
        "torch": torch.__version__,
        "muon_optimizer": muon_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backend": backend,
        "device": device,
        "load_average_start": list(os.getloadavg()),
        "cpu_bf16_matmul": cpu_bf16_matmul(),
    }
    if device == "cuda":
        gpu = torch.cuda.get_device_name()
        info.update(
            gpu=gpu,
            gpus=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            gpu_bf16_peak_tflops=bf16_peak_tflops(gpu),
        )
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
