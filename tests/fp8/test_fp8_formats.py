"""wholeshard.fp8 against slow references written from the OCP MX spec / TransformerEngine rule.

Error bounds used below, for an element x with scale s (e4m3: 3 mantissa bits, normal range
[2**-6, 448], subnormal step 2**-9):
- |x/s| in the normal range: round-to-nearest moves it by at most half an ulp, 2**-4 relative.
- |x/s| below 2**-6: at most half the subnormal step, 2**-10 * s absolute.
- FLOOR only: |x/s| in (448, 512) saturates to 448, at most 64/512 = 2**-3 relative.
So |dequantize - x| <= max(r * |x|, 2**-10 * s), r = 2**-4 (rceil, tensorwise), 2**-3 (floor).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wholeshard.fp8 import (
    MXFP8,
    Fp8Tensorwise,
    dequantize,
    quantize_mxfp8,
    quantize_tensorwise,
)

E4M3 = torch.float8_e4m3fn
INF, NAN = float("inf"), float("nan")


def u8(t):
    return t.view(torch.uint8)


def ref_mxfp8(x, axis, rule):
    """Per block: amax, scale exponent from frexp on float64, clamp to e8m0's [-127, 127],
    NaN scale (and NaN elements) for inf/nan amax, elements e4m3(float32(x) / scale)."""
    xt = x.float().movedim(axis, -1)
    rows = xt.reshape(-1, xt.shape[-1])
    data = torch.empty(rows.shape, dtype=torch.uint8)
    scale = torch.empty(rows.shape[0], rows.shape[1] // 32, dtype=torch.uint8)
    for r in range(rows.shape[0]):
        for j in range(rows.shape[1] // 32):
            block = rows[r, 32 * j : 32 * j + 32]
            amax = max(abs(float(v)) for v in block)
            if math.isnan(amax) or math.isinf(amax) or any(math.isnan(float(v)) for v in block):
                scale[r, j] = 255
                data[r, 32 * j : 32 * j + 32] = 0x7F
                continue
            if amax == 0:
                k = -127
            elif rule == "floor":  # 2**(floor(log2(amax)) - emax), emax(e4m3) = 8
                k = math.frexp(amax)[1] - 1 - 8
            else:  # 2**ceil(log2(amax / 448)); amax / 448 is a power of 2 only when exact
                m, e = math.frexp(amax / 448)
                k = e - 1 if m == 0.5 else e
            k = max(-127, min(127, k))
            scale[r, j] = k + 127
            s = torch.tensor(2.0**k, dtype=torch.float32)
            data[r, 32 * j : 32 * j + 32] = u8((block / s).to(E4M3))
    data = data.reshape(xt.shape).movedim(-1, axis)
    scale = scale.reshape(*xt.shape[:-1], -1).movedim(-1, axis)
    return data, scale


def assert_matches_ref(x, axis, rule):
    q = quantize_mxfp8(x, axis=axis, scale_rule=rule)
    data, scale = ref_mxfp8(x, axis, rule)
    assert q.data.dtype == E4M3 and q.scale.dtype == torch.float8_e8m0fnu
    assert q.data.shape == x.shape and q.scale.shape == scale.shape
    assert torch.equal(u8(q.scale), scale)
    assert torch.equal(u8(q.data), data)
    return q


def edge_tensor(dtype):
    """64x64: every 32-block along either axis sees a mix of the cases below."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g)
    x *= 2.0 ** torch.randint(-12, 4, (64, 1), generator=g).float()  # per-row magnitudes
    x[0:4] *= 2.0**-120  # tiny: scale clamps at 2**-127 for some blocks
    x[4:6] = torch.randn(2, 64, generator=g) * 1e-40  # float32 subnormals
    x[6, :] = 0.0
    x[:, 40:41] = 0.0
    x[0:32, 0:32] = 0.0  # a whole zero block along either axis
    x[7, ::2] = 0.0  # zeros inside blocks
    x[8, 33] = 1e4  # outliers
    x[9, 60] = -3e5
    # amax mantissa around 1.75 (where rceil and floor differ) at several exponents
    for i, m in enumerate([1.75, 1.7578125, 1.75 + 2**-23, 1.75 - 2**-23, 1.8125, 1.999]):
        x[10 + i, 32:64] = x[10 + i, 32:64].clamp(-1, 1)
        x[10 + i, 35] = -m * 2.0 ** (3 * i - 7)
        x[40, 32 + i] = m * 2.0**100
    x[20, 3] = INF
    x[21, 50] = -INF
    x[22, 10] = NAN
    x[50, 50] = 2.0**-149  # smallest subnormal in an otherwise normal block
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("axis", [0, 1, -1, -2])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mxfp8_matches_reference_on_edge_cases(dtype, axis, rule):
    assert_matches_ref(edge_tensor(dtype), axis, rule)


def test_rules_differ_exactly_above_mantissa_1_75():
    for m, differ in [(1.0, False), (1.75, False), (1.75 + 2**-23, True), (1.999, True)]:
        for e in (-130, -20, 0, 7, 100):
            x = torch.full((32,), 0.5 * 2.0**e)
            x[5] = m * 2.0**e
            r, f = (u8(quantize_mxfp8(x, scale_rule=s).scale).item() for s in ("rceil", "floor"))
            if f == 0 and r <= 1:  # both clamped at 2**-127 (e = -130): no room to differ
                continue
            assert (r == f + 1) if differ else (r == f), (m, e, r, f)
    edge = edge_tensor(torch.float32)
    r, f = (quantize_mxfp8(edge, scale_rule=s) for s in ("rceil", "floor"))
    assert not torch.equal(u8(r.scale), u8(f.scale))
    assert not torch.equal(u8(r.data), u8(f.data))


def test_zero_and_nonfinite_blocks():
    x = torch.zeros(4, 32)
    x[1, 0], x[2, 31], x[3, 7] = INF, NAN, -INF
    x[1:, 1] = 3.0
    for rule in ("rceil", "floor"):
        q = quantize_mxfp8(x, scale_rule=rule)
        assert u8(q.scale).flatten().tolist() == [0, 255, 255, 255]  # 2**-127, then NaN
        assert torch.all(u8(q.data[0]) == 0) and torch.all(u8(q.data[1:]) == 0x7F)
        out = dequantize(q, torch.float32)
        assert torch.all(out[0] == 0) and torch.all(out[1:].isnan())


def element_scales(q, axis):
    """Each element's scale as float32 (its block's scale)."""
    return q.scale.float().repeat_interleave(32, dim=axis)


def check_error_bound(x, q, s, rel):
    x = x.float()
    err = (dequantize(q, torch.float32) - x).abs()
    bound = torch.maximum(rel * x.abs(), 2.0**-10 * s)
    finite = x.isfinite() & s.isfinite()
    assert torch.all(err[finite] <= bound[finite])


@st.composite
def mx_case(draw):
    ndim = draw(st.integers(1, 3))
    axis = draw(st.integers(-ndim, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[axis] = 32 * draw(st.integers(1, 2))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(shape, generator=g) * 2.0 ** draw(st.integers(-140, 120))
    x *= 2.0 ** torch.randint(-20, 1, shape, generator=g).float()
    flat = x.view(-1)
    for v in draw(st.lists(st.sampled_from([0.0, INF, -INF, NAN, 1e-45, 3e38]), max_size=2)):
        flat[draw(st.integers(0, flat.numel() - 1))] = v
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return x.to(dtype), axis, draw(st.sampled_from(["rceil", "floor"]))


@settings(max_examples=60, deadline=None)
@given(mx_case())
def test_mxfp8_random_shapes_match_reference(case):
    x, axis, rule = case
    q = assert_matches_ref(x, axis, rule)
    again = quantize_mxfp8(x, axis=axis, scale_rule=rule)
    assert torch.equal(u8(again.data), u8(q.data)) and torch.equal(u8(again.scale), u8(q.scale))
    check_error_bound(x, q, element_scales(q, axis), 2.0**-4 if rule == "rceil" else 2.0**-3)
    # quantize(dequantize(q)): same values always; same bytes for floor, and for rceil
    # except blocks whose largest element is 224 (see test_rceil_requantize_224).
    back = quantize_mxfp8(dequantize(q, torch.float32), axis=axis, scale_rule=rule)
    d0, d1 = dequantize(q, torch.float32), dequantize(back, torch.float32)
    assert torch.equal(d0.isnan(), d1.isnan()) and torch.equal(d0.nan_to_num(), d1.nan_to_num())
    if rule == "floor":
        assert torch.equal(u8(back.data), u8(q.data)) and torch.equal(u8(back.scale), u8(q.scale))


def test_round_trip_is_bitwise_idempotent():
    for rule in ("rceil", "floor"):
        x = edge_tensor(torch.bfloat16)
        for axis in (0, 1):
            q = quantize_mxfp8(x, axis=axis, scale_rule=rule)
            back = quantize_mxfp8(dequantize(q, torch.bfloat16), axis=axis, scale_rule=rule)
            blockmax = q.data.float().abs().nan_to_num().movedim(axis, -1)
            blockmax = blockmax.reshape(*blockmax.shape[:-1], -1, 32).amax(-1).movedim(-1, axis)
            # floor: every block; rceil: all but blocks whose largest element is 224
            keep = blockmax != 224 if rule == "rceil" else torch.ones_like(blockmax, dtype=bool)
            assert torch.equal(u8(back.scale)[keep], u8(q.scale)[keep])
            same = keep.repeat_interleave(32, dim=axis)
            assert torch.equal(u8(back.data)[same], u8(q.data)[same])


def test_rceil_requantize_224():
    """rceil: amax/scale in (224, 232) rounds to 224 = 448/2, and requantizing that picks the
    next smaller scale: same values, different bytes. floor has no such case."""
    x = torch.ones(32)
    x[0] = 1.8  # mantissa > 1.75: scale 2**-7, 1.8 * 2**7 = 230.4 -> 224
    q = quantize_mxfp8(x, scale_rule="rceil")
    assert u8(q.scale).item() == 127 - 7 and q.data[0].float().item() == 224
    back = quantize_mxfp8(dequantize(q, torch.float32), scale_rule="rceil")
    assert u8(back.scale).item() == 127 - 8
    assert torch.equal(dequantize(back, torch.float32), dequantize(q, torch.float32))


def test_dequantize_axis_inference():
    g = torch.Generator().manual_seed(1)
    for shape, axis in [
        ((32,), 0),
        ((32, 32), 0),
        ((32, 32), 1),
        ((2, 64, 32), -2),
        ((1, 32), 1),
        ((32, 1), 0),
        ((3, 2, 96), 2),
    ]:
        x = torch.randn(shape, generator=g)
        q = quantize_mxfp8(x, axis=axis)
        scale = q.scale.float().repeat_interleave(32, dim=axis)
        assert torch.equal(dequantize(q, torch.float32), q.data.float() * scale)
        assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16
    empty = quantize_mxfp8(torch.zeros(0, 32))
    assert dequantize(empty, torch.float32).shape == (0, 32)
    with pytest.raises(ValueError, match="not an MXFP8 pair"):
        dequantize(MXFP8(q.data, q.scale[:, :1]), torch.float32)  # 2 dims differ


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"multiple of 32.*pad.*bf16"):
        quantize_mxfp8(torch.zeros(4, 33))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.zeros(40, 64), axis=0)
    with pytest.raises(ValueError, match="unknown scale_rule"):
        quantize_mxfp8(torch.zeros(32), scale_rule="nearest")
    with pytest.raises(ValueError, match="out of range"):
        quantize_mxfp8(torch.zeros(32), axis=1)


def test_tensorwise_definition_and_bounds():
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        for e in (-100, -10, 0, 10, 100):
            x = (torch.randn(7, 33, generator=g) * 2.0**e).to(dtype)
            x[0, 0] = 0.0
            x[1, :5] = 2.0 ** (e - 15)  # below e4m3's normal range after scaling
            q = quantize_tensorwise(x)
            assert isinstance(q, Fp8Tensorwise) and q.scale.shape == () and q.data.shape == x.shape
            amax = x.float().abs().amax()
            assert q.scale.dtype == torch.float32 and q.scale == amax / 448
            assert torch.equal(u8(q.data), u8((x.float() / q.scale).to(E4M3)))
            assert q.data.float().abs().max() == 448  # amax lands on 448; nothing overflows
            # x / scale and data * scale each add <= 2**-24 relative: slack 2**-20 on r.
            check_error_bound(x, q, q.scale.expand(x.shape), 2.0**-4 * (1 + 2.0**-20))
            back = quantize_tensorwise(dequantize(q, torch.float32))
            assert torch.equal(u8(back.data), u8(q.data))
            assert abs(back.scale.item() - q.scale.item()) <= 2.0**-23 * q.scale.item()


def test_tensorwise_edges():
    q = quantize_tensorwise(torch.zeros(3, 4))
    assert q.scale == 1.0 and torch.all(u8(q.data) == 0)
    for bad in (INF, -INF, NAN):
        q = quantize_tensorwise(torch.tensor([1.0, bad, 2.0]))
        assert q.scale.isnan() and torch.all(u8(q.data) == 0x7F)
    q = quantize_tensorwise(torch.tensor([2.0**-149, -(2.0**-148)]))  # amax/448 underflows
    assert q.scale == 2.0**-149 and torch.equal(
        dequantize(q, torch.float32), torch.tensor([2.0**-149, -(2.0**-148)])
    )
    # saturation: .to(e4m3) clips, it does not produce NaN, for a scale set too small
    assert u8(torch.tensor([1e6, -1e6]).to(E4M3)).tolist() == [0x7E, 0xFE]


def test_torchao_matches_bf16():
    """torchao.prototype.mx_formats to_mx, bf16 input, finite data with amax >= 2**-100.
    Known differences outside that (torchao 0.18, CPU fallback): rceil maps inf amax to scale
    254 and leaves byte-0 blocks unscaled; floor maps inf amax to a finite scale, divides
    byte-0 blocks by 2**-126, and zeroes the non-NaN elements of NaN blocks; rceil computes
    ceil(log2(amax/448)) in float32, which can miss fp32 mantissas just above 1.75."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g)
    x *= 2.0 ** torch.randint(-100, 100, (64, 8, 1), generator=g).float().repeat_interleave(
        32, dim=1
    ).squeeze(-1)
    x[0, :32] = 0.0
    for i, m in enumerate([1.75, 1.7578125, 1.8125, 1.9921875, 1.0]):
        x[1 + i, 32:64] = x[1 + i, 32:64].clamp(-1, 1)
        x[1 + i, 40] = m
    x = x.bfloat16()
    modes = {"rceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}
    for rule, mode in modes.items():
        scale, data = mx.to_mx(x, E4M3, 32, scaling_mode=mode)
        q = quantize_mxfp8(x, scale_rule=rule)
        assert torch.equal(u8(q.scale), u8(scale).reshape(q.scale.shape)), rule
        assert torch.equal(u8(q.data), u8(data)), rule
