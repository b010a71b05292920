"""FP8 compute: `wholeshard.fp8.convert` and `Fp8Linear` (the emulated GEMMs here; the real
`torch._scaled_mm` path and the choice between them in test_fp8_gemm.py)."""

from __future__ import annotations

import pytest
import torch
from support import DIM, assert_overlap_equals_sync, make_model
from torch import nn

from wholeshard import fp8
from wholeshard.fp8 import Fp8Linear, convert, dequantize, quantize_weight


def converted(recipe: str = "mxfp8") -> nn.Module:
    return convert(make_model(), recipe)


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_convert_turns_muon_linears_in_place(recipe: str) -> None:
    model = make_model()
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    assert convert(model, recipe) is model
    fp8_names = {name for name, _ in fp8.fp8_modules(model)}
    assert fp8_names == {f"blocks.{i}.{m}" for i in range(2) for m in ("qkv", "proj", "fc", "out")}
    assert type(model.head) is nn.Linear, "the output head is AdamW's: not converted"
    assert dict(model.named_parameters()) == params, "the same Parameter objects"
    assert all(modules[n] is m for n, m in model.named_modules()), "the same module objects"
    assert all(m.recipe == recipe and m.fp8_weight is None for _, m in fp8.fp8_modules(model))
    assert all(m.gemm == "auto" and m.last_gemm is None for _, m in fp8.fp8_modules(model))


def test_mxfp8_leaves_weights_off_the_block_grid_in_bf16() -> None:
    model = nn.Sequential(nn.Linear(DIM, 48), nn.Linear(48, 64), nn.Linear(64, 64))
    with pytest.warns(UserWarning, match=r"left in bf16: 0.weight \(48, 32\), 1.weight \(64, 48\)"):
        convert(model, "mxfp8", matrix_params=lambda name, p: p.ndim == 2)
    assert [type(m) for m in model] == [nn.Linear, nn.Linear, Fp8Linear]
    convert(model, "tensorwise", matrix_params=lambda name, p: p.ndim == 2)  # any shape
    assert all(type(m) is Fp8Linear for m in model)


def test_unknown_recipe_or_gemm() -> None:
    with pytest.raises(ValueError, match="unknown FP8 recipe 'fp4'"):
        convert(make_model(), "fp4")
    with pytest.raises(ValueError, match="unknown FP8 gemm 'cublas'"):
        convert(make_model(), "tensorwise", gemm="cublas")


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_emulated_gemms_use_the_quantized_weight_and_a_high_precision_weight_grad(
    recipe: str,
) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 96).to(torch.bfloat16)
    ref = nn.Linear(64, 96).to(torch.bfloat16)
    ref.load_state_dict(lin.state_dict())
    convert(lin, recipe, matrix_params=lambda name, p: p.ndim == 2, gemm="emulated")
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(3, 5, 96, dtype=torch.bfloat16)

    lin(x1).backward(dy)
    q = quantize_weight(ref.weight, recipe)
    w_row = dequantize(q.rowwise, torch.bfloat16)
    y = torch.nn.functional.linear(x2, w_row, ref.bias)
    assert torch.equal(lin(x1.detach()), y.detach())
    dx = dy @ dequantize(q.colwise, torch.bfloat16)
    dw = dy.reshape(-1, 96).t() @ x.reshape(-1, 64)
    assert torch.equal(x1.grad, dx)
    assert torch.equal(lin.weight.grad, dw)
    assert torch.equal(lin.bias.grad, dy.reshape(-1, 96).sum(0))
    assert not torch.equal(w_row, ref.weight.detach()), "the forward used FP8 values"
    assert lin.last_gemm == "emulated"


def test_a_set_fp8_weight_is_used_instead_of_quantizing() -> None:
    torch.manual_seed(0)
    lin = convert(nn.Linear(64, 64), "tensorwise", matrix_params=lambda name, p: p.ndim == 2)
    x = torch.randn(4, 64)
    on_the_fly = lin(x)
    lin.fp8_weight = quantize_weight(lin.weight, "tensorwise")
    assert torch.equal(lin(x), on_the_fly)
    lin.fp8_weight = quantize_weight(torch.zeros_like(lin.weight), "tensorwise")
    assert torch.equal(lin(x), lin.bias.expand(4, 64))


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_converted_model_trains_and_overlap_equals_sync(recipe: str) -> None:
    sync = assert_overlap_equals_sync(
        2, 3, dict(bucket_size=3000), make=lambda: converted(recipe), param_dtype=torch.bfloat16
    )
    losses = sync[0]["losses"]
    assert losses[-1] < losses[0], losses
