"""FP8 in wholeshard: the number formats (`formats`), the FP8 linear's GEMMs and which of them
runs (`gemm`: the real `torch._scaled_mm` or the emulation), and FP8 compute for the
matrix-routed linear layers (`linear`: `convert`, `Fp8Linear`)."""

from .formats import MXFP8, Fp8Tensorwise, dequantize, quantize_mxfp8, quantize_tensorwise
from .gemm import Backend, gemm_backend, select_gemm
from .linear import (
    RECIPES,
    Fp8Linear,
    Fp8Weight,
    convert,
    fp8_linear,
    fp8_modules,
    quantize_weight,
)

__all__ = [
    "MXFP8",
    "RECIPES",
    "Backend",
    "Fp8Linear",
    "Fp8Tensorwise",
    "Fp8Weight",
    "convert",
    "dequantize",
    "fp8_linear",
    "fp8_modules",
    "gemm_backend",
    "quantize_mxfp8",
    "quantize_tensorwise",
    "quantize_weight",
    "select_gemm",
]
