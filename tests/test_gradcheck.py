"""torch.autograd.gradcheck in float64 on the CPU backend (both variants' CPU twins), for
every differentiable op and the layouts its backward treats differently: the analytic
grads (our backward kernels) against finite differences of our forward, computed in
double. The CUDA kernels take no float64 (test_bad_inputs checks that they refuse it);
their grads are compared with the fp64 reference's in test_autograd."""

import pytest
import torch
import torch.nn.functional as F

from conftest import TARGETS, load_variant
from reference import adaln_ref, rms_norm_ref, rope_ref

CPU_TARGETS = [backend for backend, device in TARGETS if device == "cpu"]
D64 = torch.float64


@pytest.fixture(params=CPU_TARGETS, ids=[f"{b}-variant-on-cpu" for b in CPU_TARGETS])
def kernel(request):
    return load_variant(request.param)


def leaves(*shapes, scale=1.0, offset=0.0):
    return [(torch.randn(*s, dtype=D64) * scale + offset).requires_grad_() for s in shapes]


def check(fn, inputs):
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("weighted, offset", [(True, 0.0), (True, 1.0), (False, 0.0)])
def test_rms_norm(kernel, weighted, offset):
    x, w = leaves((3, 5, 24), (24,))
    if weighted:
        check(lambda x, w: kernel.rms_norm(x, w, 1e-6, weight_offset=offset), (x, w))
    else:
        check(lambda x: kernel.rms_norm(x, None, 1e-6), (x,))


def test_fused_add_rms_norm(kernel):
    x, r, w = leaves((4, 24), (4, 24), (24,))
    check(lambda x, r, w: kernel.fused_add_rms_norm(x, r, w, 1e-6), (x, r, w))


# [D], [B, D], [B, 1, D] and per-token [B, S, D] scale/shift: each reduces its grad differently
@pytest.mark.parametrize("mod_shape", [(16,), (2, 16), (2, 1, 16), (2, 3, 16)])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_adaln(kernel, norm, mod_shape):
    x, = leaves((2, 3, 16), offset=0.5)  # an offset mean: LayerNorm's centring matters
    scale, shift = leaves(mod_shape, mod_shape, scale=0.3)
    check(lambda x, sc, sh: kernel.adaln(x, sc, sh, 1e-6, norm=norm), (x, scale, shift))


@pytest.mark.parametrize("gate_shape", [(2, 16), (2, 3, 16)])
def test_gated_residual(kernel, gate_shape):
    r, x, gate = leaves((2, 3, 16), (2, 3, 16), gate_shape)
    check(lambda r, x, g: kernel.gated_residual(r, x, g), (r, x, gate))


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_gated_residual_adaln(kernel, norm):
    r, x = leaves((2, 3, 16), (2, 3, 16))
    gate, scale, shift = leaves((2, 1, 16), (2, 1, 16), (2, 3, 16), scale=0.3)
    check(lambda *t: kernel.gated_residual_adaln(*t, 1e-6, norm=norm), (r, x, gate, scale, shift))


def tables(batch, seq, dim, interleaved):
    angle = torch.rand(batch, seq, dim // 2, dtype=D64) * 6.0
    angle = angle.repeat_interleave(2, -1) if interleaved else torch.cat([angle, angle], -1)
    return angle.cos(), angle.sin()


@pytest.mark.parametrize("rotary", [8, 6])  # all channels, or a partial rotary dim
def test_rope_rotate_half(kernel, rotary):
    q, k = leaves((1, 4, 5, 8), (1, 2, 5, 8))  # GQA: k has fewer heads
    cos, sin = tables(1, 5, rotary, interleaved=False)
    check(lambda q, k: kernel.rope_rotate_half(q, k, cos, sin), (q, k))


def test_rope_interleaved(kernel):
    q, k = leaves((2, 5, 12), (2, 5, 12))  # LTX's [B, S, C]
    cos, sin = tables(2, 5, 12, interleaved=True)
    check(lambda q, k: kernel.rope_interleaved(q, k, cos, sin, sequence_dim=1), (q, k))


def test_qk_norm_rope(kernel):
    q, k, wq, wk = leaves((2, 5, 12), (2, 5, 12), (12,), (12,))
    cos, sin = tables(2, 5, 12, interleaved=True)
    check(lambda *t: kernel.qk_norm_rope(*t, cos, sin, 1e-5), (q, k, wq, wk))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_activations(kernel, approximate):
    x, gate, up = leaves((3, 20), (3, 10), (3, 10), scale=2.0)
    check(lambda x: kernel.gelu(x, approximate), (x,))
    check(lambda g, u: kernel.gelu_mul(g, u, approximate), (gate, up))
    check(lambda x: kernel.geglu(x, approximate), (x,))


def test_float64_forward_is_double_precision(kernel):
    """The float64 forward is the fp64 reference to rounding, not an fp32 result widened."""
    x, w, sc, sh = (t.detach() for t in leaves((3, 5, 24), (24,), (3, 1, 24), (3, 1, 24)))
    cos, sin = tables(3, 5, 24, interleaved=True)
    pairs = [
        (kernel.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)),
        (kernel.adaln(x, sc, sh, 1e-6, norm="layer"), adaln_ref(x, sc, sh, 1e-6, "layer")),
        (kernel.rope_interleaved(x, x, cos, sin, sequence_dim=1)[0], rope_ref(x[:, None], cos, sin, True)[:, 0]),
        (kernel.gelu(x, "none"), F.gelu(x)),
        (kernel.gelu(x, "tanh"), F.gelu(x, approximate="tanh")),
    ]
    for ours, expected in pairs:
        assert ours.dtype == D64
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_float64_backward_is_double_precision(kernel, norm):
    """AdaLN's backward in float64 recomputes the row statistics rather than read the fp32
    ones its forward saves: its grads are the fp64 reference's to rounding."""
    x, sc, sh = leaves((3, 5, 24), (3, 1, 24), (3, 1, 24))
    residual, gate = leaves((3, 5, 24), (3, 1, 24))
    grad_out = torch.randn(3, 5, 24, dtype=D64)

    def gated(residual, x, gate, sc, sh):
        total = residual + x * gate
        return total, adaln_ref(total, sc, sh, 1e-6, norm)

    cases = [
        (lambda x, sc, sh: kernel.adaln(x, sc, sh, 1e-6, norm=norm),
         lambda x, sc, sh: adaln_ref(x, sc, sh, 1e-6, norm), (x, sc, sh)),
        (lambda *a: kernel.gated_residual_adaln(*a, 1e-6, norm=norm)[1], lambda *a: gated(*a)[1],
         (residual, x, gate, sc, sh)),
    ]
    for ours, reference, inputs in cases:
        got = torch.autograd.grad(ours(*inputs), inputs, grad_out)
        expected = torch.autograd.grad(reference(*inputs), inputs, grad_out)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


def test_float64_takes_no_float32_beside_it(kernel):
    """float64 is all of a call's tensors: the fp32 weights, tables and outputs that 16-bit
    inputs may take are refused beside it, and the message offers no float32."""
    x = torch.randn(2, 5, 8, dtype=D64)
    cos, sin = (t.float() for t in tables(2, 5, 8, interleaved=True))
    calls = {
        "weight has dtype Float but input has dtype Double$": lambda: kernel.rms_norm(x, torch.ones(8), 1e-6),
        "out has dtype Float but input has dtype Double$": lambda: kernel.rms_norm(x, None, 1e-6, out_dtype=torch.float32),
        r"cos has dtype Float; expected q's dtype \(Double\)$": lambda: kernel.rope_interleaved(x, x, cos, sin,
                                                                                                sequence_dim=1),
    }
    for message, call in calls.items():
        with pytest.raises(RuntimeError, match=message):
            call()


def _differentiated(kernel):
    """name -> (fn, float64 leaves, the op named when differentiated twice)."""
    cos, sin = tables(2, 5, 8, interleaved=False)
    icos, isin = tables(2, 5, 8, interleaved=True)
    return {
        "rms_norm": (lambda x, w: kernel.rms_norm(x, w, 1e-6), leaves((3, 8), (8,)), "rms_norm_backward"),
        "fused_add_rms_norm": (lambda x, r, w: kernel.fused_add_rms_norm(x, r, w, 1e-6),
                               leaves((3, 8), (3, 8), (8,)), "rms_norm_backward"),
        "adaln": (lambda x, sc, sh: kernel.adaln(x, sc, sh, 1e-6, norm="layer"),
                  leaves((2, 3, 8), (2, 1, 8), (2, 1, 8), scale=0.5), "adaln_backward"),
        "gated_residual": (lambda r, x, g: kernel.gated_residual(r, x, g), leaves((2, 3, 8), (2, 3, 8), (2, 1, 8)),
                           "gated_residual_backward"),
        "gated_residual_adaln": (lambda *t: kernel.gated_residual_adaln(*t, 1e-6, norm="rms"),
                                 leaves((2, 3, 8), (2, 3, 8), (2, 1, 8), (2, 1, 8), (2, 1, 8), scale=0.5),
                                 "gated_residual_adaln_backward"),
        "rope_rotate_half": (lambda q, k: kernel.rope_rotate_half(q, k, cos, sin), leaves((2, 2, 5, 8), (2, 1, 5, 8)),
                             "rope_backward"),
        "rope_interleaved": (lambda q, k: kernel.rope_interleaved(q, k, icos, isin), leaves((2, 5, 8), (2, 5, 8)),
                             "rope_backward"),
        "qk_norm_rope": (lambda *t: kernel.qk_norm_rope(*t, icos, isin, 1e-5), leaves((2, 5, 8), (2, 5, 8), (8,), (8,)),
                         "(rope|rms_norm)_backward"),
        "gelu": (lambda x: kernel.gelu(x, "none"), leaves((3, 8)), "gelu_backward"),
        "gelu_mul": (lambda g, u: kernel.gelu_mul(g, u, "tanh"), leaves((3, 8), (3, 8)), "gelu_mul_backward"),
        "geglu": (lambda x: kernel.geglu(x, "tanh"), leaves((3, 8)), "geglu_backward"),
    }


DIFFERENTIATED = list(_differentiated(None))


@pytest.mark.parametrize("name", DIFFERENTIATED)
def test_double_backward_raises_naming_the_op(kernel, name):
    """create_graph=True gives the first-order grads; differentiating those raises (the
    backward kernels have no derivative), as torch's once_differentiable does, instead of
    returning wrong second derivatives."""
    fn, inputs, backward_op = _differentiated(kernel)[name]
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    cotangents = [torch.randn_like(o) for o in outputs]
    plain = torch.autograd.grad(outputs, inputs, cotangents, retain_graph=True)
    graphed = torch.autograd.grad(outputs, inputs, cotangents, create_graph=True)
    for p, g in zip(plain, graphed):
        torch.testing.assert_close(g, p, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=rf"{backward_op}: double backward is not supported"):
        torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.parametrize("name", DIFFERENTIATED)
def test_forward_mode_ad_raises_naming_the_op(kernel, name):
    """No op has a forward-mode formula: gradcheck's forward-AD check meets a clear error
    instead of zero tangents."""
    fn, inputs, _ = _differentiated(kernel)[name]
    op = "rope" if name.startswith("rope_") else name
    with pytest.raises(NotImplementedError, match=rf"{op}: forward-mode AD"):
        torch.autograd.gradcheck(fn, inputs, check_forward_ad=True, check_backward_ad=False,
                                 check_undefined_grad=False)
