"""The FP8 linear layer's two GEMMs, `y = x W^T` and `dx = dy W`, and which implementation runs.

Two implementations (`Backend`):
- "scaled_mm": a real FP8 GEMM, `torch._scaled_mm`, for the tensorwise recipe. The activation
  is quantized tensorwise too: x to e4m3 for the forward, dy to e5m2 for the input gradient
  (as TransformerEngine's HYBRID format and torchao do: gradients want range more than
  precision); the weight is its e4m3 data and scale. Scales are float32 tensors on the device,
  decided there (`torch.where`), never read on the host. Products accumulate in float32 (no
  fast accumulation); the bias, where its dtype is the output's, is added in the GEMM's epilogue.
- "emulated": the weight dequantized to the activation dtype, then a matmul in that dtype. The
  weight's FP8 numbers with high-precision activations: exact for the FP8 weight, as slow as
  bf16. MXFP8 is always emulated (a real MXFP8 GEMM needs sm100 and torch's blocked scale
  layout; not done).

Which runs (`select_gemm`): "scaled_mm" where `gemm_backend(device, "tensorwise")` says so and
the shapes fit the CUDA kernel (`scaled_mm_fits`: in and out features multiples of 16, a
bf16/fp16/fp32 activation, not empty), else "emulated". `gemm_backend` decides once per device:
CUDA with compute capability >= (8, 9) (not ROCm, whose FP8 dtypes differ), the CPU where this
torch has the op (2.13 has; it computes in float32 from the same FP8 inputs). The shape rule is
applied on every device, so a CPU run takes the branch a GPU run would. Setting the environment
variable `WHOLESHARD_FP8_GEMM=emulated` forces the emulation (read at every forward; a module
under torch.compile keeps the choice it was traced with); `auto` or unset is the rule above.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.nn.functional as F

from .formats import MXFP8, Fp8Tensorwise, dequantize, quantize_tensorwise

Backend = Literal["scaled_mm", "emulated"]
ENV = "WHOLESHARD_FP8_GEMM"
ENV_CHOICES = ("auto", "emulated")
MULTIPLE = 16  # cuBLASLt FP8: K and N multiples of 16
_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FUSED_BIAS_DTYPES = (torch.bfloat16, torch.float16)  # what the CUDA kernel adds in its epilogue
_RECIPES = ("mxfp8", "tensorwise")


def emulation_forced() -> bool:
    """Whether `WHOLESHARD_FP8_GEMM=emulated` is set (a value outside ENV_CHOICES raises)."""
    value = os.environ.get(ENV, "auto")
    if value not in ENV_CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {ENV_CHOICES}")
    return value == "emulated"


def gemm_backend(device: torch.device | str, recipe: str) -> Backend:
    """The GEMM `recipe`'s layers use on `device` for shapes that fit (`scaled_mm_fits`):
    "scaled_mm" for tensorwise where the device has a real FP8 GEMM and the emulation is not
    forced, else "emulated". The device's answer is decided once and cached."""
    if recipe not in _RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {_RECIPES}")
    if recipe != "tensorwise" or emulation_forced():
        return "emulated"
    return "scaled_mm" if _has_scaled_mm(_normalised(torch.device(device))) else "emulated"


def _normalised(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


_HAS_SCALED_MM: dict[torch.device, bool] = {}  # decided once per device


@torch.compiler.assume_constant_result  # torch.compile bakes the answer in: no graph break
def _has_scaled_mm(device: torch.device) -> bool:
    """Whether `device` runs a tensorwise `torch._scaled_mm` (host-side facts only: no sync)."""
    if device not in _HAS_SCALED_MM:
        if device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            _HAS_SCALED_MM[device] = torch.version.hip is None and capability >= (8, 9)
        else:
            _HAS_SCALED_MM[device] = device.type == "cpu" and _cpu_has_scaled_mm()
    return _HAS_SCALED_MM[device]


def _cpu_has_scaled_mm() -> bool:
    """Tries the op once on a 16 x 16 case and checks it scales as `dequantize` does."""
    a = torch.full((MULTIPLE, MULTIPLE), 2.0).to(torch.float8_e4m3fn)
    b = torch.eye(MULTIPLE).to(torch.float8_e4m3fn)
    try:
        y = torch._scaled_mm(
            a, b.t(), scale_a=torch.tensor(0.5), scale_b=torch.tensor(4.0), out_dtype=torch.float32
        )
    except (AttributeError, NotImplementedError, RuntimeError, TypeError, ValueError):
        return False
    return bool(torch.equal(y, torch.full((MULTIPLE, MULTIPLE), 4.0)))


def scaled_mm_fits(x: torch.Tensor, weight: MXFP8 | Fp8Tensorwise) -> bool:
    """Whether `x @ weight^T` and its input gradient fit a tensorwise `torch._scaled_mm` on any
    device: a tensorwise e4m3 weight, both its dims multiples of 16 (each is K in one GEMM and N
    in the other), a bf16/fp16/fp32 activation on the weight's device, no empty dim."""
    if not isinstance(weight, Fp8Tensorwise) or weight.data.dtype != torch.float8_e4m3fn:
        return False
    out_features, in_features = weight.data.shape
    return (
        x.dtype in _ACTIVATION_DTYPES
        and x.device == weight.data.device
        and x.numel() > 0
        and out_features > 0
        and in_features % MULTIPLE == 0
        and out_features % MULTIPLE == 0
    )


def select_gemm(
    x: torch.Tensor, weight: MXFP8 | Fp8Tensorwise, *, emulated: bool = False
) -> Backend:
    """The GEMM for `x @ weight^T` (and its input gradient): "scaled_mm" where the device has it
    for the recipe and the shapes fit, else "emulated" (always with `emulated=True`)."""
    if emulated or not scaled_mm_fits(x, weight):
        return "emulated"
    return gemm_backend(x.device, "tensorwise")


def linear_forward(
    backend: Backend, x: torch.Tensor, weight: MXFP8 | Fp8Tensorwise, bias: torch.Tensor | None
) -> torch.Tensor:
    """`y = x weight^T + bias` in x's dtype, by `backend` (module docstring)."""
    if backend == "emulated":
        return F.linear(x, dequantize(weight, x.dtype), bias)
    assert isinstance(weight, Fp8Tensorwise)
    x2 = x.reshape(-1, x.shape[-1])
    xq = quantize_tensorwise(x2, torch.float8_e4m3fn)
    # mat2 = W^T, column-major because W's data (out, in) is row-major.
    y = _scaled_mm(xq, _row_major(weight.data).t(), weight.scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linear_input_grad(
    backend: Backend, dy: torch.Tensor, weight: MXFP8 | Fp8Tensorwise
) -> torch.Tensor:
    """`dx = dy weight` in dy's dtype, by `backend` (module docstring)."""
    if backend == "emulated":
        return dy @ dequantize(weight, dy.dtype)
    assert isinstance(weight, Fp8Tensorwise)
    dy2 = dy.reshape(-1, dy.shape[-1])
    dyq = quantize_tensorwise(dy2, torch.float8_e5m2)
    # mat2 = W (out, in), column-major: the transpose of a row-major copy of W^T (1 byte/elem).
    w_t = weight.data.t().contiguous()
    dx = _scaled_mm(dyq, w_t.t(), weight.scale, None, dy.dtype)
    return dx.reshape(*dy.shape[:-1], dx.shape[-1])


def _row_major(data: torch.Tensor) -> torch.Tensor:
    """`data`, contiguous and 256 bytes into its storage (whose start the allocator aligns), as
    a fresh tensor is. An FP8 weight may be a view into a gathered buffer at any byte offset:
    cuBLASLt needs 16-byte aligned operands and picks its kernel by alignment, so a view would
    not always sum as a fresh copy does. Under torch.compile the compiler owns layouts."""
    if torch.compiler.is_compiling():
        return data.contiguous()
    if data.is_contiguous() and data.storage_offset() * data.element_size() % 256 == 0:
        return data
    return data.clone(memory_format=torch.contiguous_format)


def _scaled_mm(
    a: Fp8Tensorwise,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`dequantize(a) @ b * b_scale (+ bias)` in `out_dtype`: `a.data` row-major, `b`
    column-major, both FP8, scales 0-d float32 on the device."""
    fused = bias is not None and bias.dtype == out_dtype and out_dtype in _FUSED_BIAS_DTYPES
    y = torch._scaled_mm(
        _row_major(a.data),
        b,
        scale_a=a.scale,
        scale_b=b_scale.float(),
        bias=bias if fused else None,
        out_dtype=out_dtype,
        use_fast_accum=False,
    )
    if bias is not None and not fused:
        y = y + bias
    return y
