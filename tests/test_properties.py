"""Property tests: random shapes, dtypes, eps, strides and storage offsets (so random
alignments), every op against its fp64 reference. Bounded example counts keep the CPU
run short; the same tests run on the GPU."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference import (TOLERANCE, adaln_ref, assert_close, gated_residual_ref, rms_norm_ref)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


def strided(draw, rows, cols, dtype, device, scale=1.0):
    """A [rows, cols] view with a random row padding and storage offset."""
    pad = draw(st.integers(0, 9))
    offset = draw(st.integers(0, 7))
    buf = (torch.randn(offset + rows * (cols + pad) + 1) * scale).to(device=device, dtype=dtype)
    return buf[offset:offset + rows * (cols + pad)].view(rows, cols + pad)[:, :cols]


@SETTINGS
@given(data=st.data(), rows=st.integers(0, 40), cols=st.integers(1, 3000), dtype=DTYPES,
       eps=st.floats(1e-8, 1e-2), offset=st.sampled_from([0.0, 1.0]), cast=st.booleans(), weight=st.booleans())
def test_rms_norm_property(kernel, device, data, rows, cols, dtype, eps, offset, cast, weight):
    x = strided(data.draw, rows, cols, dtype, device, scale=3.0)
    w = strided(data.draw, 1, cols, dtype, device)[0] if weight else None
    y = kernel.rms_norm(x, w, eps, weight_offset=offset, cast_before_weight=cast)
    assert_close(y, rms_norm_ref(x, w, eps, offset, cast), dtype, roundings=2 if cast else 1,
                 atol=4 * TOLERANCE[dtype]["rtol"] if cast else 1e-5)


@SETTINGS
@given(data=st.data(), rows=st.integers(1, 30), cols=st.integers(1, 2500), dtype=DTYPES)
def test_fused_add_rms_norm_property(kernel, device, data, rows, cols, dtype):
    x, res = (strided(data.draw, rows, cols, dtype, device) for _ in range(2))
    w = strided(data.draw, 1, cols, dtype, device)[0]
    y, h = kernel.fused_add_rms_norm(x, res, w, 1e-6)
    h_ref = (x.double() + res.double()).to(dtype)
    assert torch.equal(h, h_ref)
    assert_close(y, rms_norm_ref(h_ref, w, 1e-6), dtype)


@SETTINGS
@given(data=st.data(), b=st.integers(1, 3), s=st.integers(1, 20), d=st.integers(1, 1200), dtype=DTYPES,
       norm=st.sampled_from(["rms", "layer"]), mode=st.sampled_from(["batch", "token", "shared"]))
def test_adaln_and_gated_residual_property(kernel, device, data, b, s, d, dtype, norm, mode):
    x = strided(data.draw, b * s, d, dtype, device, scale=2.0).view(b, s, d)
    mod_shape = {"batch": (b, d), "token": (b, s, d), "shared": (d,)}[mode]
    scale, shift, gate = ((torch.randn(mod_shape) * 0.3).to(device=device, dtype=dtype) for _ in range(3))
    y = kernel.adaln(x, scale, shift, 1e-6, norm=norm)
    assert_close(y, adaln_ref(x, scale, shift, 1e-6, norm), dtype, atol=1e-3 if dtype == torch.float32 else 0.05)
    res = torch.randn(b, s, d).to(device=device, dtype=dtype)
    h, z = kernel.gated_residual_adaln(res, x, gate, scale, shift, 1e-6, norm=norm)
    assert_close(h, gated_residual_ref(res, x, gate), dtype)
    assert_close(z, adaln_ref(h, scale, shift, 1e-6, norm), dtype, atol=1e-3 if dtype == torch.float32 else 0.05)


@SETTINGS
@given(data=st.data(), b=st.integers(1, 2), hq=st.integers(1, 5), hkv=st.integers(1, 3),
       s=st.one_of(st.integers(1, 12), st.integers(600, 620)),  # many tokens: CUDA's four-heads path where aligned
       half_r=st.integers(1, 40), extra=st.integers(0, 9), dtype=DTYPES, interleaved=st.booleans(),
       fp32_table=st.booleans(), transposed=st.booleans())
def test_rope_property(kernel, device, data, b, hq, hkv, s, half_r, extra, dtype, interleaved, fp32_table, transposed):
    r = 2 * half_r
    d = r + extra
    def make(h):
        t = torch.randn(b, s, h, d) if transposed else torch.randn(b, h, s, d)
        t = t.to(device=device, dtype=dtype)
        return t.transpose(1, 2) if transposed else t
    q, k = make(hq), make(hkv)
    tdtype = torch.float32 if fp32_table else dtype
    cos, sin = (torch.randn(b, s, r).to(device=device, dtype=tdtype) for _ in range(2))
    fn = kernel.rope_interleaved if interleaved else kernel.rope_rotate_half
    q_out, k_out = fn(q, k, cos, sin)
    for x, out in ((q, q_out), (k, k_out)):
        x64, c, sn = x.double(), cos.double()[:, None], sin.double()[:, None]
        rot = x64[..., :r]
        if interleaved:
            real, imag = rot.unflatten(-1, (-1, 2)).unbind(-1)
            turned = torch.stack([-imag, real], -1).flatten(-2)
        else:
            turned = torch.cat([-rot[..., half_r:], rot[..., :half_r]], -1)
        expected = torch.cat([rot * c + turned * sn, x64[..., r:]], -1)
        # cos/sin are not unit here: products up to ~|x| * 3, so an absolute term too.
        assert_close(out, expected, dtype, roundings=2, atol=8 * TOLERANCE[dtype]["rtol"])


@SETTINGS
@given(data=st.data(), rows=st.integers(0, 30), h=st.integers(1, 1500), dtype=DTYPES,
       approximate=st.sampled_from(["none", "tanh"]))
def test_geglu_property(kernel, device, data, rows, h, dtype, approximate):
    x = strided(data.draw, rows, 2 * h, dtype, device, scale=2.0)
    expected = x[:, :h].double() * torch.nn.functional.gelu(x[:, h:].double(), approximate=approximate)
    assert_close(kernel.geglu(x, approximate), expected, dtype)
