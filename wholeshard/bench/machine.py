"""What a bench run was measured on: the `"machine"` of its JSON and the line under its table."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any


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


SLOW_BF16 = "none"
"""`cpu_bf16_matmul()` on an x86 CPU with neither AVX512-BF16 nor AMX."""


def cpu_bf16_matmul() -> str:
    """What runs this CPU's bf16 matmuls at full rate: "AMX", "AVX512-BF16", `SLOW_BF16` (an x86
    CPU with neither: torch takes a slow path, a 1024x1024 product seconds where fp32 takes
    milliseconds), or "unknown" (another architecture, or a torch without the probes)."""
    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "unknown"
    try:  # private helpers of torch.cpu: absent means unknown
        if torch.cpu._is_amx_tile_supported():
            return "AMX"
        return "AVX512-BF16" if torch.cpu._is_avx512_bf16_supported() else SLOW_BF16
    except AttributeError:
        return "unknown"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
