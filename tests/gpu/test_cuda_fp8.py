"""The GPU tier for FP8 (`make test-gpu`, marker `cuda`): quantization bitwise the CPU's, the
real FP8 GEMM (`torch._scaled_mm`) where the GPU has one, agreeing with the CPU's within FP8
bounds, and no host sync in an FP8 layer's forward and backward.

Every test skips without CUDA. test_cuda.py holds the first quantization cases (tensorwise e4m3
and MXFP8 rceil along the last axis, from float32); these extend them.
"""

from __future__ import annotations

import pytest
import torch
from support import cuda_deterministic, fp8_model, run_cuda, wholeshard_run
from torch import nn

from wholeshard import fp8
from wholeshard.fp8 import gemm
from wholeshard.fp8.formats import dequantize, quantize_mxfp8, quantize_tensorwise

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _has_fp8_gemm() -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9)


def _sources() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, 96, generator=g) * torch.logspace(-12, 12, 96)
    x[0, 0, :6] = torch.tensor([0.0, -0.0, 1e-40, -448.0, 57344.0, 3e38])
    special = x.clone()
    special[1, 3, 5], special[1, 40, 70] = float("nan"), float("-inf")
    tiny = x * 2.0**-125
    return [x, special, tiny, x.bfloat16(), x.half(), torch.zeros(4, 32, 32)]


def _bits(d: torch.Tensor) -> list[torch.Tensor]:
    """Where `d` is NaN, and its bits elsewhere (a NaN's payload is the hardware's)."""
    nan = d.isnan()
    return [nan, torch.where(nan, 0, d).view(torch.int16 if d.itemsize == 2 else torch.int32)]


def _quantized_on(device: str) -> list[torch.Tensor]:
    """Bytes of every quantization and bits of every dequantization, computed on `device`.
    (The sources' NaNs are positive: the byte of a NaN element carries the sign of x / NaN.)"""
    out = []
    for source in _sources():
        t = source.to(device)
        for kind in (E4M3, E5M2):
            q = quantize_tensorwise(t, kind)
            out += [q.data.view(torch.uint8), *_bits(q.scale)]
            for dtype in (torch.bfloat16, torch.float32):
                out += _bits(dequantize(q, dtype))
        for axis in (0, 1, 2):
            if t.shape[axis] % 32:
                continue
            for rule in ("rceil", "floor"):
                q = quantize_mxfp8(t, axis=axis, scale_rule=rule)
                out += [q.data.view(torch.uint8), q.scale.view(torch.uint8)]
                for dtype in (torch.bfloat16, torch.float32, torch.float16):
                    out += _bits(dequantize(q, dtype))
    return [o.cpu() for o in out]


def test_more_fp8_quantization_on_cuda_is_bitwise_the_cpu_result() -> None:
    """e5m2 tensorwise, MXFP8 with both scale rules along every axis, bf16 and fp16 sources,
    inf and NaN, and dequantization to bf16, float32 and fp16."""
    cpu, gpu = _quantized_on("cpu"), _quantized_on("cuda")
    assert len(cpu) == len(gpu) > 100
    for i, (a, b) in enumerate(zip(cpu, gpu, strict=True)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_quantize_weight_on_cuda_is_bitwise_the_cpu_result(recipe: str) -> None:
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(2))
    on_cpu, on_gpu = fp8.quantize_weight(w, recipe), fp8.quantize_weight(w.cuda(), recipe)
    for a, b in zip(on_cpu, on_gpu, strict=True):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8).cpu())
        assert torch.equal(a.scale.float(), b.scale.float().cpu())  # e8m0 -> float32 is exact


def test_the_shape_rule_is_the_kernels() -> None:
    """`scaled_mm_fits` says no where cuBLASLt's FP8 kernel says no, and yes to a row count
    that is not a multiple of 16."""
    if not _has_fp8_gemm():
        assert gemm.gemm_backend("cuda", "tensorwise") == "emulated"
        pytest.skip("no FP8 GEMM below sm89: the emulation runs (checked)")
    scale = torch.ones((), device="cuda")

    def scaled_mm(m: int, k: int, n: int) -> torch.Tensor:
        a = torch.randn(m, k, device="cuda").to(E4M3)
        b = torch.randn(n, k, device="cuda").to(E4M3)
        return torch._scaled_mm(a, b.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)

    assert scaled_mm(6, 64, 96).shape == (6, 96)
    for k, n in ((40, 96), (64, 24)):
        weight = fp8.quantize_weight(torch.randn(n, k, device="cuda"), "tensorwise").rowwise
        assert not gemm.scaled_mm_fits(torch.randn(6, k, device="cuda"), weight)
        with pytest.raises(RuntimeError):
            scaled_mm(6, k, n)


def _layer(dtype: torch.dtype, bias: bool = True, in_f: int = 64, out_f: int = 96) -> nn.Linear:
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    return fp8.convert(lin, "tensorwise", matrix_params=lambda name, p: p.ndim == 2)


def _forward_backward(lin: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> tuple:
    x = x.clone().requires_grad_()
    y = lin(x)
    y.backward(dy)
    return y.detach(), x.grad, lin.weight.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_real_fp8_gemm_runs_from_sm89_and_agrees_with_the_cpu(dtype: torch.dtype) -> None:
    """Same FP8 inputs on both (quantization is bitwise): the GPU sums in another order, with
    FP8 tensor cores' partial sums, so the bound is each side's rounding (2**-8 each) plus
    2**-10 of the sum of |products| (the per-output size `sizes`)."""
    expected = "scaled_mm" if _has_fp8_gemm() else "emulated"
    assert gemm.gemm_backend("cuda", "tensorwise") == expected
    if expected == "emulated":
        pytest.skip("no FP8 GEMM below sm89: the emulation runs (checked)")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 10, 64, generator=g).to(dtype)  # 60 rows: not a multiple of 16
    dy = torch.randn(6, 10, 96, generator=g).to(dtype)
    on_cpu, on_gpu = _layer(dtype), _layer(dtype).cuda()
    cpu = _forward_backward(on_cpu, x, dy)
    gpu = [t.cpu() for t in _forward_backward(on_gpu, x.cuda(), dy.cuda())]
    assert on_cpu.last_gemm == on_gpu.last_gemm == "scaled_mm"

    w = dequantize(fp8.quantize_weight(on_cpu.weight, "tensorwise").rowwise, torch.float32).abs()
    xq = dequantize(quantize_tensorwise(x, E4M3), torch.float32).abs()
    dyq = dequantize(quantize_tensorwise(dy, E5M2), torch.float32).abs()
    for a, b, sizes in ((cpu[0], gpu[0], xq @ w.t()), (cpu[1], gpu[1], dyq @ w)):
        err = (a.float() - b.float()).abs()
        assert (err <= 2.0**-7 * a.float().abs() + 2.0**-10 * sizes).all(), err.max()
    # dW = dy^T x in the param dtype, unquantized: the same up to summation order.
    torch.testing.assert_close(gpu[2], cpu[2], rtol=2.0**-7, atol=1e-3)


def test_a_shape_off_the_grid_falls_back_on_cuda() -> None:
    lin = _layer(torch.bfloat16, in_f=40).cuda()
    x = torch.randn(6, 40, device="cuda", dtype=torch.bfloat16)
    y = _forward_backward(lin, x, torch.randn(6, 96, device="cuda", dtype=torch.bfloat16))[0]
    assert lin.last_gemm == "emulated"
    w = dequantize(fp8.quantize_weight(lin.weight, "tensorwise").rowwise, torch.bfloat16)
    assert torch.equal(y, nn.functional.linear(x, w, lin.bias).detach())


def _fp8_step(lin: nn.Linear, x: torch.Tensor) -> None:
    x = x.clone().requires_grad_()
    lin(x).float().pow(2).mean().backward()


@pytest.mark.parametrize("recipe", fp8.RECIPES)
@pytest.mark.parametrize("held", [False, True], ids=["quantize-in-forward", "fp8-weight-set"])
def test_fp8_forward_and_backward_do_not_sync_the_host(recipe: str, held: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 96).to(torch.bfloat16).cuda()
    fp8.convert(lin, recipe, matrix_params=lambda name, p: p.ndim == 2)
    if held:
        lin.fp8_weight = fp8.quantize_weight(lin.weight, recipe)
    x = torch.randn(12, 64, device="cuda", dtype=torch.bfloat16)
    _fp8_step(lin, x)  # warm: cuBLAS handles and workspaces, the device's capability
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _fp8_step(lin, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    real = recipe == "tensorwise" and _has_fp8_gemm()
    assert lin.last_gemm == ("scaled_mm" if real else "emulated")


def _last_gemms(model: nn.Module) -> list[str | None]:
    return [m.last_gemm for _, m in fp8.fp8_modules(model)]


def _fp8_run(fp8_param_gather: bool) -> dict:
    cuda_deterministic()
    return wholeshard_run(
        3,
        make=fp8_model("tensorwise"),
        param_dtype=torch.bfloat16,
        ddp_kw=dict(bucket_size=3000, fp8_param_gather=fp8_param_gather),
        probe=_last_gemms,
        device="cuda",
    )


def test_fp8_param_gather_on_cuda_is_bitwise_equal_through_the_real_gemm() -> None:
    """As tests/fp8/test_fp8_gather.py on the CPU: both paths call the same GEMM on the same
    bits (a gathered weight is a view into a shared buffer; the GEMM copies a misaligned one)."""
    expected = "scaled_mm" if _has_fp8_gemm() else "emulated"
    off = run_cuda(_fp8_run, 2, False)
    on = run_cuda(_fp8_run, 2, True)
    for a, b in zip(off, on, strict=True):
        assert a["probe"] == b["probe"] == [expected] * 8
        assert a["losses"] == b["losses"]
        for name, value in a["params"].items():
            assert torch.equal(b["params"][name], value), name
