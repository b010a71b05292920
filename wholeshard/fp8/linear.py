"""FP8 compute for matrix-routed linear layers: `convert(module, recipe)` and `Fp8Linear`.

`Fp8Linear` multiplies with its weight quantized (`quantize_weight`): a rowwise copy for the
forward GEMM `y = x W^T` (blocks along `in`, the reduction dim) and a columnwise copy for the
input-gradient GEMM `dx = dy W` (blocks along `out`); the weight gradient `dW = dy^T x` stays in
high precision. A tensorwise scale has no orientation, so one copy serves both. The source of
every quantization is `bf16(weight)`.

The two GEMMs run as `gemm.select_gemm` decides, once per forward, for both: the real FP8 GEMM
(`torch._scaled_mm`, tensorwise, activations quantized too) where the device has it and the
shapes fit, else the emulation (dequantize, then a matmul in the activation dtype). The module
records which ran in `last_gemm`; `convert(..., gemm="emulated")` or the environment variable
`WHOLESHARD_FP8_GEMM=emulated` forces the emulation.

Without `DataParallel(..., fp8_param_gather=True)` the weight stays a bf16 param and is
quantized at every forward; with it, the wrapper sets `fp8_weight` once per step and the forward
uses that instead (the same bits through the same GEMM, so both paths train identically).
"""

from __future__ import annotations

import warnings
from typing import Literal, NamedTuple

import torch
from torch import nn

from ..planning.routing import MatrixParams, route_params
from .formats import BLOCK, MXFP8, Fp8Tensorwise, quantize_mxfp8, quantize_tensorwise
from .gemm import Backend, linear_forward, linear_input_grad, select_gemm

RECIPES = ("mxfp8", "tensorwise")
GEMMS = ("auto", "emulated")


class Fp8Weight(NamedTuple):
    """A weight in FP8: `rowwise` for the forward GEMM, `colwise` for the input gradient (the
    same object for tensorwise)."""

    rowwise: MXFP8 | Fp8Tensorwise
    colwise: MXFP8 | Fp8Tensorwise


def quantize_weight(weight: torch.Tensor, recipe: str) -> Fp8Weight:
    """`bf16(weight)` (out, in) in FP8 as `recipe` says."""
    source = weight.detach().to(torch.bfloat16)
    if recipe == "mxfp8":
        return Fp8Weight(quantize_mxfp8(source, axis=-1), quantize_mxfp8(source, axis=0))
    if recipe == "tensorwise":
        q = quantize_tensorwise(source)
        return Fp8Weight(q, q)
    raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {RECIPES}")


class _Fp8Linear(torch.autograd.Function):
    """y = x rowwise^T; dx = dy colwise, both by `backend`; dW = dy^T x in high precision."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Fp8Weight, backend: Backend):  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.fp8, ctx.backend = fp8, backend
        ctx.weight_dtype, ctx.has_bias = weight.dtype, bias is not None
        return linear_forward(backend, x, fp8.rowwise, bias)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = linear_input_grad(ctx.backend, dy, ctx.fp8.colwise)
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = (dy2.t() @ x.reshape(-1, x.shape[-1])).to(ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fp8: Fp8Weight,
    *,
    backend: Backend | None = None,
) -> torch.Tensor:
    """The linear layer with `fp8` standing for `weight` in both GEMMs, run by `backend`
    (None: `select_gemm(x, fp8.rowwise)`); the weight gradient is `dy^T x`, unquantized."""
    if backend is None:
        backend = select_gemm(x, fp8.rowwise)
    return _Fp8Linear.apply(x, weight, bias, fp8, backend)


class Fp8Linear(nn.Linear):
    """An `nn.Linear` that computes with its weight in FP8 (module docstring). `convert` turns
    existing `nn.Linear`s into this class in place: same module and Parameter objects.
    `gemm`: "auto" (the real FP8 GEMM where it runs) or "emulated". `last_gemm`: the backend
    of the latest forward (None before the first)."""

    recipe: str
    gemm: str = "auto"
    fp8_weight: Fp8Weight | None
    last_gemm: Backend | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8 = self.fp8_weight
        if fp8 is None:
            fp8 = quantize_weight(self.weight, self.recipe)
        backend = select_gemm(x, fp8.rowwise, emulated=self.gemm == "emulated")
        self.last_gemm = backend
        return fp8_linear(x, self.weight, self.bias, fp8, backend=backend)


def convert(
    module: nn.Module,
    recipe: str = "mxfp8",
    *,
    matrix_params: MatrixParams | None = None,
    gemm: Literal["auto", "emulated"] = "auto",
) -> nn.Module:
    """Turn every matrix-routed `nn.Linear` of `module` into an `Fp8Linear` (in place; returns
    `module`). Routing is `wholeshard.route_params(module, matrix_params)`'s. Only modules whose
    class is exactly `nn.Linear` are converted (a subclass may not call its own forward). With
    `mxfp8`, a weight whose dims are not both multiples of 32 stays bf16, with a warning naming
    it. `gemm="emulated"` keeps these layers off the real FP8 GEMM. Convert before wrapping the
    model in `DataParallel`."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {RECIPES}")
    if gemm not in GEMMS:
        raise ValueError(f"unknown FP8 gemm {gemm!r}; choose one of {GEMMS}")
    muon = {id(r.param) for r in route_params(module, matrix_params) if r.matrix}
    skipped = []
    for name, mod in module.named_modules():
        if type(mod) is not nn.Linear or id(mod.weight) not in muon:
            continue
        if recipe == "mxfp8" and any(d % BLOCK for d in mod.weight.shape):
            skipped.append(f"{name}.weight {tuple(mod.weight.shape)}")
            continue
        mod.__class__ = Fp8Linear
        mod.recipe, mod.gemm, mod.fp8_weight, mod.last_gemm = recipe, gemm, None, None
    if skipped:
        warnings.warn(
            f"mxfp8 needs both dims of a weight to be multiples of {BLOCK}; left in bf16: "
            + ", ".join(skipped),
            stacklevel=2,
        )
    return module


def fp8_modules(module: nn.Module) -> list[tuple[str, Fp8Linear]]:
    """Every `Fp8Linear` of `module`, with its name."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, Fp8Linear)]
