"""FP8 number formats: MXFP8 (per-32-block e8m0 scales) and tensorwise e4m3, in plain torch.

In wholeshard the source of every weight quantization is `bf16(master)`: the fp32 master weight
cast to bf16 first (quantizing from fp32 instead changes about 3% of the fp8 bytes). The GEMMs
that consume these tensors are in `gemm`; this module only encodes and decodes.

Formats (OCP Microscaling spec v1.0):
- elements are float8_e4m3fn (max 448, no inf, NaN = 0x7F/0xFF); a value is `data * scale`.
- MXFP8: one float8_e8m0fnu scale per 32 consecutive elements along one axis. An e8m0 byte b
  is the value 2**(b - 127); b = 255 is NaN.
- tensorwise: one float32 scale, amax / 448, for the whole tensor. Gradients for a real FP8
  GEMM may use float8_e5m2 instead (max 57344): then the scale is amax / 57344.

Scale rules for MXFP8 (amax = max |x| over the block, computed in float32):
- "rceil" (TransformerEngine, cuBLAS, Megatron): scale = 2**ceil(log2(amax / 448)), computed
  exactly, so no element overflows 448.
- "floor" (OCP spec, torchao's default): scale = 2**(floor(log2(amax)) - 8); elements in
  (448, 512) * scale saturate to 448.
The two differ only when amax's mantissa is above 1.75 (448 = 1.75 * 2**8).
Scales come from the float32 exponent bits (not `.to(float8_e8m0fnu)`, which rounds half up).

Edge cases: an all-zero block gets the smallest scale, 2**-127 (byte 0), as in torchao; a
scale below 2**-127 is clamped there (its elements are then smaller than the exact rule would
give). A block whose amax is inf or NaN gets the NaN scale (byte 255) and all its elements are
NaN (0x7F), so dequantize gives NaN for the whole block.

gloo cannot send float8 tensors: callers send `t.view(torch.uint8)` (bit-exact).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 32
E4M3_MAX = 448.0
_E4M3_NAN = 0x7F
_TENSORWISE_MAX = {torch.float8_e4m3fn: E4M3_MAX, torch.float8_e5m2: 57344.0}
_SCALE_RULES = ("rceil", "floor")


class MXFP8(NamedTuple):
    """`data`: e4m3, the input's shape. `scale`: e8m0, the input's shape with the quantized
    axis divided by 32; `scale[..., i, ...]` covers `data[..., 32*i : 32*i + 32, ...]`."""

    data: torch.Tensor
    scale: torch.Tensor


class Fp8Tensorwise(NamedTuple):
    """`data`: e4m3 (e5m2 where asked), the input's shape. `scale`: 0-d float32, amax / 448
    (e5m2: amax / 57344; 1.0 if amax is 0)."""

    data: torch.Tensor
    scale: torch.Tensor


def _e8m0_bytes(amax: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """Biased e8m0 exponents (int32 in [0, 255]) of the block scales for float32 `amax` >= 0."""
    bits = amax.view(torch.int32)
    exp = (bits >> 23) & 0xFF  # biased float32 exponent: floor(log2(amax)) + 127 when normal
    # floor: floor(log2 amax) - 8, biased: exp - 8. rceil: amax / 448 = 2**(e-8) * m / 1.75
    # with m in [1, 2), so ceil(log2) is e - 8 for m <= 1.75 and e - 7 above (mantissa bits
    # 0x600000 are exactly 1.75). A subnormal amax (exp 0) is below 2**-126: clamped to 0.
    b = exp - 8
    if scale_rule == "rceil":
        b = b + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    b = b.clamp(0, 254)
    return torch.where(exp == 255, 255, b)  # inf or nan amax -> NaN scale


def quantize_mxfp8(x: torch.Tensor, *, axis: int = -1, scale_rule: str = "rceil") -> MXFP8:
    """MXFP8 of `x` (taken as float32) in blocks of 32 along `axis`; deterministic.
    Elements are e4m3(x / scale), saturating at +-448; a block with inf or NaN is all NaN."""
    if scale_rule not in _SCALE_RULES:
        raise ValueError(f"unknown scale_rule {scale_rule!r}; expected one of {_SCALE_RULES}")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} out of range for a {x.dim()}-d tensor")
    n = x.shape[axis]
    if n % BLOCK:
        raise ValueError(
            f"MXFP8 needs the size along axis {axis} to be a multiple of {BLOCK}, got shape "
            f"{tuple(x.shape)}; pad that axis to a multiple of {BLOCK} or leave this tensor "
            "in bf16"
        )
    xt = x.float().movedim(axis, -1)
    blocks = xt.reshape(*xt.shape[:-1], n // BLOCK, BLOCK)
    b = _e8m0_bytes(blocks.abs().amax(-1).contiguous(), scale_rule)
    scale = b.to(torch.uint8).view(torch.float8_e8m0fnu)
    # Division by a power of two is exact; the e4m3 cast rounds to nearest even and saturates.
    data = (blocks / scale.float().unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    data = torch.where((b == 255).unsqueeze(-1), _E4M3_NAN, data)  # one NaN encoding
    data = data.view(torch.float8_e4m3fn).reshape(xt.shape)
    return MXFP8(data.movedim(-1, axis).contiguous(), scale.movedim(-1, axis).contiguous())


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> Fp8Tensorwise:
    """`dtype` (e4m3 or e5m2) of `x / scale` (taken as float32, saturating) with scale = amax /
    max(dtype). amax 0 -> scale 1.0. amax inf or NaN -> scale NaN and all data NaN. A scale
    that would underflow float32 (amax < ~2**-141) is clamped to 2**-149. Decided on the device
    (no host sync): the scale stays where `x` is."""
    if dtype not in _TENSORWISE_MAX:
        raise ValueError(f"tensorwise FP8 is e4m3 or e5m2, got {dtype}")
    if x.numel():
        lo, hi = torch.aminmax(x)  # exact in x's dtype; no |x| temporary
        amax = torch.maximum(hi, -lo).float()
    else:
        amax = x.new_zeros((), dtype=torch.float32)
    # A device tensor, not a Python number: CUDA divides by a host scalar as a multiplication by
    # its float32 reciprocal, 1 ulp off the CPU's quotient (448 is no power of two).
    top = torch.full_like(amax, _TENSORWISE_MAX[dtype])
    scale = torch.where(amax == 0, 1.0, (amax / top).clamp_min(2.0**-149))
    scale = torch.where(torch.isfinite(amax), scale, float("nan"))  # x / NaN: all data NaN
    xf = x.to(torch.float32, copy=True)  # one float32 temporary, divided in place
    return Fp8Tensorwise(xf.div_(scale).to(dtype), scale)


def _mx_axis(data: torch.Tensor, scale: torch.Tensor) -> int | None:
    """The quantized axis: the one dim where scale's size differs from data's (data's is 32x).
    Every other dim must match. None when data is empty (any axis gives the same result)."""
    if data.dim() != scale.dim():
        raise ValueError(f"MXFP8 data {tuple(data.shape)} and scale {tuple(scale.shape)} differ")
    diff = [d for d in range(data.dim()) if data.shape[d] != scale.shape[d]]
    if not diff and data.numel() == 0:
        return None
    if len(diff) != 1 or data.shape[diff[0]] != BLOCK * scale.shape[diff[0]]:
        raise ValueError(
            f"not an MXFP8 pair: data {tuple(data.shape)}, scale {tuple(scale.shape)}; expected "
            f"equal shapes except one dim where data's size is {BLOCK}x scale's"
        )
    return diff[0]


def dequantize(q: MXFP8 | Fp8Tensorwise, dtype: torch.dtype) -> torch.Tensor:
    """`data * scale` (MXFP8: each scale broadcast over its 32-block) in `dtype`, bitwise as if
    computed in float32 and cast: tensorwise multiplies in float32 (its scale is any float32),
    MXFP8 straight in bf16 or float32 (a product of an e4m3 value and a power of two is exact
    in float32, so rounding it once to `dtype` is the same), other dtypes through float32. The
    only temporaries are the float32 product (tensorwise) or none but the result (MXFP8)."""
    if isinstance(q, Fp8Tensorwise):
        return q.data.float().mul_(q.scale.float()).to(dtype)
    if not isinstance(q, MXFP8):
        raise TypeError(f"expected MXFP8 or Fp8Tensorwise, got {type(q).__name__}")
    axis = _mx_axis(q.data, q.scale)
    if axis is None:
        return q.data.to(dtype)
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    out = q.data.to(work, memory_format=torch.contiguous_format)  # exact; a fresh tensor
    blocks = out.unflatten(axis, (q.data.shape[axis] // BLOCK, BLOCK))  # a view of `out`
    blocks.mul_(q.scale.float().to(work).unsqueeze(axis + 1))
    return out.to(dtype)
