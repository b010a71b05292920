"""The FP8 linear's GEMMs (`wholeshard.fp8.gemm`): the real `torch._scaled_mm` path against
references, which GEMM runs where (and the report of it), forcing the emulation, the fallback,
and the emulation's temporaries.

Bounds, for e4m3 (3 mantissa bits) and e5m2 (2), with q(v) the quantized value of v, s its
tensorwise scale and r = 2**-4 (e4m3) or 2**-3 (e5m2) half an ulp:
|q(v) - v| <= r |v| + t s, with t = 2**-10 (e4m3) or 2**-17 (e5m2) half the subnormal step.
A bf16 result rounds a float32 value once: at most 2**-8 of it.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from support import fp8_model, run, wholeshard_run
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from wholeshard import fp8
from wholeshard.fp8 import gemm
from wholeshard.fp8.formats import dequantize, quantize_mxfp8, quantize_tensorwise

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HALF_ULP = {E4M3: 2.0**-4, E5M2: 2.0**-3}
HALF_SUBNORMAL = {E4M3: 2.0**-10, E5M2: 2.0**-17}


def layer(
    in_f: int = 64,
    out_f: int = 96,
    dtype: torch.dtype = torch.bfloat16,
    bias: bool = True,
    recipe: str = "tensorwise",
    **kw,
) -> nn.Linear:
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    return fp8.convert(lin, recipe, matrix_params=lambda name, p: p.ndim == 2, **kw)


def emulated(lin: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> tuple:
    """The emulation's y and dx: the FP8 weight, high-precision activations."""
    q = fp8.quantize_weight(lin.weight, lin.recipe)
    y = F.linear(x, dequantize(q.rowwise, x.dtype), lin.bias)
    return y.detach(), dy @ dequantize(q.colwise, dy.dtype)


def forward_backward(lin: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> tuple:
    x = x.clone().requires_grad_()
    y = lin(x)
    y.backward(dy)
    return y.detach(), x.grad


class Spy:
    """Counts calls of `torch._scaled_mm` (after the CPU's one-off probe of the op)."""

    def __init__(self, monkeypatch) -> None:
        gemm.gemm_backend("cpu", "tensorwise")
        self.calls = 0
        original = torch._scaled_mm

        def spy(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(torch, "_scaled_mm", spy)


def test_which_gemm_each_recipe_and_device_gets() -> None:
    assert gemm.gemm_backend("cpu", "tensorwise") == "scaled_mm", "torch 2.13 has it on the CPU"
    assert gemm.gemm_backend("cpu", "mxfp8") == "emulated"
    assert gemm.gemm_backend("meta", "tensorwise") == "emulated"
    with pytest.raises(ValueError, match="unknown FP8 recipe 'fp4'"):
        gemm.gemm_backend("cpu", "fp4")


@pytest.mark.parametrize(
    ("capability", "hip", "expected"),
    [
        ((8, 0), None, "emulated"),
        ((8, 6), None, "emulated"),
        ((8, 9), None, "scaled_mm"),
        ((9, 0), None, "scaled_mm"),
        ((10, 0), None, "scaled_mm"),
        ((9, 4), "6.4", "emulated"),
    ],
)
def test_cuda_needs_sm89_and_not_rocm(monkeypatch, capability, hip, expected) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    gemm._HAS_SCALED_MM.clear()
    try:
        assert gemm.gemm_backend(torch.device("cuda", 3), "tensorwise") == expected
        assert gemm.gemm_backend(torch.device("cuda", 3), "mxfp8") == "emulated"
    finally:
        gemm._HAS_SCALED_MM.clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_real_path_is_the_gemm_of_the_quantized_activation_and_weight(
    monkeypatch, dtype: torch.dtype, bias: bool
) -> None:
    """Against float32 GEMMs of x in e4m3 and dy in e5m2 (tensorwise, as `gemm` quantizes
    them) with the FP8 weight: one rounding to `dtype` plus float32 accumulation order."""
    lin = layer(dtype=dtype, bias=bias)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    dy = torch.randn(3, 5, 96, generator=g).to(dtype) * 1e-3
    spy = Spy(monkeypatch)
    y, dx = forward_backward(lin, x, dy)
    assert lin.last_gemm == "scaled_mm" and spy.calls == 2, "forward and input gradient"

    w = dequantize(fp8.quantize_weight(lin.weight, "tensorwise").rowwise, torch.float32)
    xq = dequantize(quantize_tensorwise(x, E4M3), torch.float32)
    dyq = dequantize(quantize_tensorwise(dy, E5M2), torch.float32)
    ref_y = xq @ w.t() + (lin.bias.float() if bias else 0)
    ref_dx = dyq @ w
    for got, ref, sizes in ((y, ref_y, xq.abs() @ w.abs().t()), (dx, ref_dx, dyq.abs() @ w.abs())):
        assert got.dtype == dtype
        err = (got.float() - ref).abs()
        assert (err <= 2.0**-8 * ref.abs() + 2.0**-16 * sizes).all(), err.max()

    # The weight gradient stays in high precision: dy^T x, unquantized.
    dy2, x2 = dy.reshape(-1, 96), x.reshape(-1, 64)
    assert torch.equal(lin.weight.grad, dy2.t() @ x2)
    if bias:
        assert torch.equal(lin.bias.grad, dy2.sum(0))


def test_real_path_is_within_fp8_bounds_of_the_emulation_and_near_bf16() -> None:
    """The two paths differ by the activation's quantization only: per output, at most
    sum_k |w_k| (r |v_k| + t s) over the quantized activation v, plus each side's rounding."""
    lin = layer()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 8, 64, generator=g).bfloat16()
    dy = torch.randn(4, 8, 96, generator=g).bfloat16()
    y, dx = forward_backward(lin, x, dy)
    assert lin.last_gemm == "scaled_mm"
    emu_y, emu_dx = emulated(lin, x, dy)
    w = dequantize(fp8.quantize_weight(lin.weight, "tensorwise").rowwise, torch.float32).abs()
    for got, emu, v, wk, kind in ((y, emu_y, x, w.t(), E4M3), (dx, emu_dx, dy, w, E5M2)):
        s = quantize_tensorwise(v, kind).scale
        bound = (HALF_ULP[kind] * v.float().abs() + HALF_SUBNORMAL[kind] * s) @ wk
        bound += 2.0**-8 * (got.float().abs() + emu.float().abs()) + 1e-6
        assert ((got.float() - emu.float()).abs() <= bound).all()
        assert not torch.equal(got, emu), "the real path quantized the activation"

    # Loosely, the bf16 linear: relative (Frobenius) errors of a few percent.
    ref = nn.Linear(64, 96).bfloat16()
    ref.load_state_dict(lin.state_dict())
    ref_y, ref_dx = forward_backward(ref, x, dy)
    assert (y - ref_y).float().norm() / ref_y.float().norm() < 0.08
    assert (dx - ref_dx).float().norm() / ref_dx.float().norm() < 0.15


@pytest.mark.parametrize(
    ("in_f", "out_f", "dtype", "rows"),
    [
        (40, 32, torch.bfloat16, 6),  # in_features not a multiple of 16
        (32, 24, torch.bfloat16, 6),  # out_features not a multiple of 16
        (32, 32, torch.float64, 6),  # no float64 FP8 GEMM output
        (32, 32, torch.bfloat16, 0),  # an empty batch
    ],
    ids=["in-40", "out-24", "fp64", "empty"],
)
def test_shapes_scaled_mm_does_not_take_fall_back_to_the_emulation(
    monkeypatch, in_f: int, out_f: int, dtype: torch.dtype, rows: int
) -> None:
    lin = layer(in_f, out_f, dtype)
    x = torch.randn(rows, in_f, dtype=dtype)
    dy = torch.randn(rows, out_f, dtype=dtype)
    spy = Spy(monkeypatch)
    y, dx = forward_backward(lin, x, dy)
    assert lin.last_gemm == "emulated" and spy.calls == 0
    emu_y, emu_dx = emulated(lin, x, dy)
    assert torch.equal(y, emu_y) and torch.equal(dx, emu_dx)


def test_mxfp8_is_emulated(monkeypatch) -> None:
    lin = layer(64, 64, recipe="mxfp8")
    spy = Spy(monkeypatch)
    forward_backward(lin, torch.randn(4, 64).bfloat16(), torch.randn(4, 64).bfloat16())
    assert lin.last_gemm == "emulated" and spy.calls == 0


def test_the_emulation_can_be_forced(monkeypatch) -> None:
    x, dy = torch.randn(6, 64).bfloat16(), torch.randn(6, 96).bfloat16()
    spy = Spy(monkeypatch)
    by_keyword = layer(gemm="emulated")
    y, dx = forward_backward(by_keyword, x, dy)
    assert by_keyword.last_gemm == "emulated" and spy.calls == 0
    emu_y, emu_dx = emulated(by_keyword, x, dy)
    assert torch.equal(y, emu_y) and torch.equal(dx, emu_dx)

    lin = layer()
    forward_backward(lin, x, dy)
    assert lin.last_gemm == "scaled_mm" and spy.calls == 2
    monkeypatch.setenv(gemm.ENV, "emulated")
    assert gemm.gemm_backend("cpu", "tensorwise") == "emulated"
    assert torch.equal(forward_backward(lin, x, dy)[0], y)
    assert lin.last_gemm == "emulated" and spy.calls == 2
    monkeypatch.setenv(gemm.ENV, "auto")
    forward_backward(lin, x, dy)
    assert lin.last_gemm == "scaled_mm" and spy.calls == 4
    monkeypatch.setenv(gemm.ENV, "cublas")
    with pytest.raises(ValueError, match="WHOLESHARD_FP8_GEMM='cublas'"):
        lin(x)


def test_the_real_path_never_reads_a_scale_on_the_host(monkeypatch) -> None:
    """What would sync a GPU: `.item()`, `bool()`, `float()`, `.tolist()` of a tensor."""
    lin = layer()
    x, dy = torch.randn(6, 64).bfloat16(), torch.randn(6, 96).bfloat16()

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor was read on the host")

    for name in ("item", "__bool__", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    forward_backward(lin, x, dy)
    assert lin.last_gemm == "scaled_mm"


def test_a_misaligned_or_strided_weight_view_gives_the_same_result() -> None:
    """An FP8 weight gathered into a shared buffer is a view at any byte offset."""
    lin = layer()
    x, dy = torch.randn(6, 64).bfloat16(), torch.randn(6, 96).bfloat16()
    y, dx = forward_backward(lin, x, dy)
    q = fp8.quantize_weight(lin.weight, "tensorwise").rowwise
    buffer = torch.zeros(q.data.numel() + 3, dtype=torch.uint8)
    buffer[3:] = q.data.view(torch.uint8).reshape(-1)
    view = fp8.Fp8Tensorwise(buffer[3:].view(E4M3).view(96, 64), q.scale)
    lin.fp8_weight = fp8.Fp8Weight(view, view)
    assert torch.equal(forward_backward(lin, x, dy)[0], y)
    assert torch.equal(forward_backward(lin, x, dy)[1], dx)


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_an_fp8_layer_compiles_to_one_graph_as_eager(recipe: str) -> None:
    lin = layer(recipe=recipe)
    compiled = torch.compile(lin, backend="aot_eager", fullgraph=True)
    x, dy = torch.randn(6, 64).bfloat16(), torch.randn(6, 96).bfloat16()
    got = forward_backward(compiled, x, dy)
    want = forward_backward(lin, x, dy)
    assert lin.last_gemm == ("scaled_mm" if recipe == "tensorwise" else "emulated")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _last_gemms(model: nn.Module) -> list[str | None]:
    return [m.last_gemm for _, m in fp8.fp8_modules(model)]


def _gather_on_and_off() -> dict:
    common = dict(make=fp8_model("tensorwise"), param_dtype=torch.bfloat16, probe=_last_gemms)
    off = wholeshard_run(3, ddp_kw=dict(bucket_size=3000), **common)
    on = wholeshard_run(3, ddp_kw=dict(bucket_size=3000, fp8_param_gather=True), **common)
    return {"off": off, "on": on}


def test_fp8_param_gather_trains_on_the_real_gemm_bitwise_as_without() -> None:
    for out in run(_gather_on_and_off, 2):
        assert out["on"]["probe"] == out["off"]["probe"] == ["scaled_mm"] * 8
        assert out["on"]["losses"] == out["off"]["losses"]
        assert out["on"]["losses"][-1] < out["on"]["losses"][0]
        for name, value in out["off"]["params"].items():
            assert torch.equal(out["on"]["params"][name], value), name


class PeakBytes(TorchDispatchMode):
    """The peak, over the ops run under it, of the bytes held by tensors those ops made (a
    storage counts once, until its last tensor made here dies)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensors alive]
        self.now = self.peak = 0

    def _died(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.live:
                self.live[ptr] = [t.untyped_storage().nbytes(), 0]
                self.now += self.live[ptr][0]
                self.peak = max(self.peak, self.now)
            self.live[ptr][1] += 1
            weakref.finalize(t, self._died, ptr)
        return out


def peak_bytes(fn, *args) -> int:
    with PeakBytes() as mode:
        result = fn(*args)
        peak = mode.peak
    del result
    return peak


def test_dequantize_and_activation_quantize_keep_few_temporaries() -> None:
    """Bytes per element at the peak: MXFP8 to bf16 holds the result (2) and its scales
    (~0.2); tensorwise a float32 product (4) and the result (2); quantizing a bf16 activation
    one float32 copy (4) and the FP8 result (1). (Before: 12, 8 and 9.)"""
    w = torch.randn(256, 512).bfloat16()
    n = w.numel()
    assert peak_bytes(dequantize, quantize_mxfp8(w), torch.bfloat16) <= 2.25 * n
    assert peak_bytes(dequantize, quantize_tensorwise(w), torch.bfloat16) <= 6 * n + 64
    assert peak_bytes(quantize_tensorwise, w) <= 5 * n + 64
