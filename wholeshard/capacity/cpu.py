"""What runs this CPU's bf16 matmuls: the one probe the train job (`--param-dtype auto`), the
bench's notes and `tools/measure_train.py` read."""

from __future__ import annotations

import platform

SLOW_BF16 = "none"
"""`cpu_bf16_matmul()` on an x86 CPU with neither AVX512-BF16 nor AMX."""
FAST_BF16 = ("AMX", "AVX512-BF16")
"""`cpu_bf16_matmul()` where bf16 matmuls run at full rate."""


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
