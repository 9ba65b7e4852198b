"""Property tests for what tests/test_properties.py leaves out: gated_residual alone,
gelu, gelu_mul, qk_norm_rope, the out-variants writing into strided, misaligned outputs,
and the layers. Random shapes, strides, storage offsets (so alignments), dtypes and eps,
against fp64 references; bounded example counts, the same on CPU and GPU."""

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from reference import TOLERANCE, assert_close, gated_residual_ref, rms_norm_ref, rounded_norm_atol
from test_bad_inputs import rope_ref, rope_tables
from test_properties import DTYPES, SETTINGS, strided

APPROXIMATE = st.sampled_from(["none", "tanh"])


def nan_filled(data, rows, cols, dtype, device):
    """An output buffer: strided and offset like an input, every element NaN."""
    out = strided(data.draw, rows, cols, dtype, device)
    out.fill_(float("nan"))
    return out


@SETTINGS
@given(data=st.data(), b=st.integers(1, 3), s=st.integers(1, 12), d=st.integers(1, 1500), dtype=DTYPES,
       mode=st.sampled_from(["shared", "batch", "token"]), use_out=st.booleans())
def test_gated_residual_property(kernel, device, data, b, s, d, dtype, mode, use_out):
    res = strided(data.draw, b * s, d, dtype, device).view(b, s, d)
    x = strided(data.draw, b * s, d, dtype, device, scale=2.0).view(b, s, d)
    if mode == "shared":
        gate = strided(data.draw, 1, d, dtype, device)[0]
    elif mode == "batch":
        gate = strided(data.draw, b, d, dtype, device)
    else:
        gate = strided(data.draw, b * s, d, dtype, device).view(b, s, d)
    out = nan_filled(data, b * s, d, dtype, device).view(b, s, d) if use_out else None
    h = kernel.gated_residual(res, x, gate, out=out)
    assert_close(h, gated_residual_ref(res, x, gate), dtype)


@SETTINGS
@given(data=st.data(), rows=st.integers(0, 30), cols=st.integers(1, 3000), dtype=DTYPES, approximate=APPROXIMATE,
       with_up=st.booleans(), use_out=st.booleans())
def test_gelu_and_gelu_mul_property(kernel, device, data, rows, cols, dtype, approximate, with_up, use_out):
    gate = strided(data.draw, rows, cols, dtype, device, scale=3.0)
    out = nan_filled(data, rows, cols, dtype, device) if use_out else None
    expected = F.gelu(gate.double(), approximate=approximate)
    if with_up:
        up = strided(data.draw, rows, cols, dtype, device, scale=2.0)
        y = kernel.gelu_mul(gate, up, approximate, out=out)
        expected = expected * up.double()
    else:
        y = kernel.gelu(gate, approximate, out=out)
    assert_close(y, expected, dtype)


@SETTINGS
@given(data=st.data(), b=st.integers(1, 2), s=st.integers(1, 9), half_c=st.integers(1, 600), dtype=DTYPES,
       fp32_table=st.booleans(), shared_table=st.booleans(), eps=st.floats(1e-8, 1e-3), use_out=st.booleans())
def test_qk_norm_rope_property(kernel, device, data, b, s, half_c, dtype, fp32_table, shared_table, eps, use_out):
    c = 2 * half_c
    q = strided(data.draw, b * s, c, dtype, device, scale=2.0).view(b, s, c)
    k = strided(data.draw, b * s, c, dtype, device, scale=2.0).view(b, s, c)
    wq, wk = (strided(data.draw, 1, c, dtype, device)[0] for _ in range(2))
    cos, sin = rope_tables(1 if shared_table else b, s, c, torch.float32 if fp32_table else dtype, device, True)
    if shared_table:
        cos, sin = cos[0], sin[0]
    out = None
    if use_out:
        out = tuple(nan_filled(data, b * s, c, dtype, device).view(b, s, c) for _ in range(2))
    q_out, k_out = kernel.qk_norm_rope(q, k, wq, wk, cos, sin, eps, out=out)
    for x, w, y in ((q, wq, q_out), (k, wk, k_out)):
        normed = F.rms_norm(x.double(), (c,), w.double(), eps).to(dtype)
        # Two roundings; ties of the first show as up to two ulp of |normed| where the
        # rotation's terms cancel (reference.rounded_norm_atol).
        expected = rope_ref(normed[:, None], cos, sin, interleaved=True)[:, 0]
        assert_close(y, expected, dtype, roundings=3, atol=rounded_norm_atol(normed, dtype))


@SETTINGS
@given(data=st.data(), b=st.integers(1, 2), h=st.integers(1, 4),
       s=st.one_of(st.integers(1, 9), st.integers(600, 620)),  # many tokens: CUDA's four-heads-per-thread path
       half_r=st.integers(1, 40), extra=st.integers(0, 9), dtype=DTYPES, interleaved=st.booleans())
def test_rope_out_variant_property(kernel, device, data, b, h, s, half_r, extra, dtype, interleaved):
    """out= into NaN-filled strided outputs: every element written, rotary or not."""
    d = 2 * half_r + extra
    q, k = (strided(data.draw, b * h * s, d, dtype, device, scale=2.0).view(b, h, s, d) for _ in range(2))
    cos, sin = rope_tables(b, s, 2 * half_r, dtype, device, interleaved)
    q_out, k_out = (nan_filled(data, b * h * s, d, dtype, device).view(b, h, s, d) for _ in range(2))
    fn = kernel.rope_interleaved if interleaved else kernel.rope_rotate_half
    returned = fn(q, k, cos, sin, out=(q_out, k_out))
    assert returned[0] is q_out and returned[1] is k_out
    for x, y in ((q, q_out), (k, k_out)):
        assert_close(y, rope_ref(x, cos, sin, interleaved), dtype)


@SETTINGS
@given(data=st.data(), rows=st.integers(0, 20), cols=st.integers(1, 2500), dtype=DTYPES, eps=st.floats(1e-8, 1e-2),
       weight_fp32=st.booleans())
def test_layers_property(kernel, device, data, rows, cols, dtype, eps, weight_fp32):
    """RMSNorm (Llama order, fp32 out for an fp32 weight) and RMSNormZeroCentered."""
    from types import SimpleNamespace

    x = strided(data.draw, rows, cols, dtype, device, scale=3.0)
    w = strided(data.draw, 1, cols, torch.float32 if weight_fp32 else dtype, device)[0]
    y = kernel.layers.RMSNorm.forward(SimpleNamespace(weight=w, variance_epsilon=eps), x)
    out_dtype = torch.promote_types(w.dtype, dtype)
    atol = 4 * TOLERANCE[dtype]["rtol"]
    # The normed value is rounded to x's dtype before the weight (two roundings of x's dtype).
    torch.testing.assert_close(y.double(), rms_norm_ref(x, w, eps, cast_before_weight=True),
                               rtol=2 * TOLERANCE[dtype]["rtol"], atol=atol)
    assert y.dtype == out_dtype
    z = kernel.layers.RMSNormZeroCentered.forward(SimpleNamespace(weight=w, eps=eps), x)
    assert_close(z, rms_norm_ref(x, w, eps, weight_offset=1.0), dtype)
