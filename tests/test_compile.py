"""torch.compile support: every op passes torch.library.opcheck (schema, fake
implementation, AOT dispatch), and a function using every op compiles with
fullgraph=True, matches eager, and does not recompile for new values of one shape."""

import pytest
import torch


def _cases(device):
    """op name -> args, for every functional, out and in-place op."""
    bf16 = dict(device=device, dtype=torch.bfloat16)
    x = torch.randn(2, 6, 64, **bf16)
    w = torch.randn(64, **bf16)
    mod = torch.randn(2, 64, **bf16)
    q, k = torch.randn(2, 4, 6, 32, **bf16), torch.randn(2, 2, 6, 32, **bf16)
    cos, sin = torch.randn(6, 32, device=device), torch.randn(6, 32, device=device)
    lq, lk = torch.randn(2, 6, 64, **bf16), torch.randn(2, 6, 64, **bf16)
    lcos, lsin = torch.randn(2, 6, 64, device=device), torch.randn(2, 6, 64, device=device)
    e = torch.zeros_like  # written outputs start defined: test_fake_checks reads them (as other dtypes)

    def g(t):  # a fresh leaf that requires grad
        return t.detach().clone().requires_grad_()

    return {
        "rms_norm": (x, w, 1e-6, 0.0, False, None),
        "rms_norm:fp32_out": (x, w.float(), 1e-6, 0.0, True, torch.float32),
        "rms_norm_out": (e(x), x, w, 1e-6, 1.0, False),
        "fused_add_rms_norm": (x, x.clone(), w, 1e-6, 0.0, True),
        "fused_add_rms_norm_out": (e(x), e(x), x, x.clone(), None, 1e-6, 0.0, False),
        "adaln": (x, mod, mod.clone(), 1e-6, "layer"),
        "adaln_out": (e(x), x, mod, mod.clone(), 1e-6, "rms"),
        "adaln_with_stats": (x, mod, mod.clone(), 1e-6, "layer"),
        "gated_residual_adaln_with_stats": (x, x.clone(), mod, mod.clone(), mod.clone(), 1e-6, "rms"),
        "gated_residual": (x, x.clone(), mod),
        "gated_residual_out": (e(x), x, x.clone(), mod),
        "gated_residual_adaln": (x, x.clone(), mod, mod.clone(), mod.clone(), 1e-6, "rms"),
        "gated_residual_adaln_out": (e(x), e(x), x, x.clone(), mod, mod.clone(), mod.clone(), 1e-6, "layer"),
        "rope": (q, k, cos, sin, False, 2),
        "rope_out": (e(q), e(k), q, k, cos, sin, True, 2),
        "rope_": (q.clone(), k.clone(), cos, sin, False, 2),
        "qk_norm_rope": (lq, lk, w, w.clone(), lcos, lsin, 1e-5),
        "qk_norm_rope_out": (e(lq), e(lk), lq, lk, w, w.clone(), lcos, lsin, 1e-5),
        "gelu": (x, "tanh"),
        "gelu_out": (e(x), x, "none"),
        "gelu_mul": (x, x.clone(), "tanh"),
        "gelu_mul_out": (e(x), x, x.clone(), "tanh"),
        "geglu": (x, "none"),
        "geglu_out": (torch.zeros(2, 6, 32, **bf16), x, "tanh"),
        "quantize_fp8": (x,),
        "quantize_fp8_static": (x, torch.tensor([0.1], device=device)),
        "rms_norm_fp8": (x, w, 1e-6, 0.0, False),
        "rms_norm_fp8_static": (x, w.float(), 1e-6, 1.0, True, torch.tensor([0.1], device=device)),
        "adaln_fp8": (x, mod, mod.clone(), 1e-6, "layer"),
        "adaln_fp8_static": (x, mod, mod.clone(), 1e-6, "rms", torch.tensor([0.1], device=device)),
        "gated_residual_adaln_fp8": (x, x.clone(), mod, mod.clone(), mod.clone(), 1e-6, "layer"),
        "gated_residual_adaln_fp8_static": (x, x.clone(), mod, mod.clone(), mod.clone(), 1e-6, "rms",
                                            torch.tensor([0.1], device=device)),
        "gelu_fp8": (x, "tanh"),
        "gelu_fp8_static": (x, "none", torch.tensor([0.1], device=device)),
        "gelu_mul_fp8": (x, x.clone(), "none"),
        "gelu_mul_fp8_static": (x, x.clone(), "tanh", torch.tensor([0.1], device=device)),
        "geglu_fp8": (x, "tanh"),
        "geglu_fp8_static": (x, "none", torch.tensor([0.1], device=device)),
        # Backward ops, and functional ops on inputs that require grad (opcheck then also
        # checks that their autograd formula is registered).
        "rms_norm_backward": (x, x.clone(), w, 1e-6, 0.0, False, None),
        "rms_norm_backward:fp32_grad_and_extra": (x.float(), x, w.float(), 1e-6, 1.0, True, x.clone()),
        "adaln_backward": (x, x.clone(), mod, mod.clone(), 1e-6, "layer", None),
        "adaln_backward:per_token": (x, x.clone(), x.clone(), x.clone(), 1e-6, "rms", x.clone()),
        "adaln_backward:stats": (x, x.clone(), mod, mod.clone(), 1e-6, "layer", None,
                                 torch.stack([torch.zeros(2, 6, device=device), torch.ones(2, 6, device=device)], -1)),
        "gated_residual_backward": (x, x.clone(), mod),
        "gated_residual_backward:per_token": (x, x.clone(), x.clone()),
        "gated_residual_adaln_backward": (x, x.clone(), x.clone(), x.clone(), mod, mod.clone(), mod.clone(), 1e-6,
                                          "layer", torch.stack([torch.zeros(2, 6, device=device),
                                                                torch.ones(2, 6, device=device)], -1)),
        "gated_residual_adaln_backward:per_token": (x, x.clone(), x.clone(), x.clone(), x.clone(), mod, x.clone(),
                                                    1e-6, "rms"),
        "rope_backward": (q, k, cos, sin, True, 2),
        "gelu_backward": (x, x.clone(), "tanh"),
        "gelu_mul_backward": (x, x.clone(), x.clone(), "none"),
        "geglu_backward": (torch.randn(2, 6, 32, **bf16), x, "none"),
        "rms_norm:grad": (g(x), g(w), 1e-6, 0.0, False, None),
        "fused_add_rms_norm:grad": (g(x), g(x), g(w), 1e-6, 0.0, True),
        "adaln:grad": (g(x), g(mod), g(mod), 1e-6, "rms"),
        "gated_residual:grad": (g(x), g(x), g(mod)),
        "gated_residual_adaln:grad": (g(x), g(x), g(mod), g(mod), g(mod), 1e-6, "layer"),
        "rope:grad": (g(q), g(k), cos, sin, True, 2),
        "qk_norm_rope:grad": (g(lq), g(lk), g(w), g(w), lcos, lsin, 1e-5),
        "gelu:grad": (g(x), "none"),
        "gelu_mul:grad": (g(x), g(x), "tanh"),
        "geglu:grad": (g(x), "tanh"),
    }


@pytest.mark.kernels_ci
@pytest.mark.parametrize("case", list(_cases("cpu")))
def test_opcheck(kernel, device, case):
    args = _cases(device)[case]
    op = getattr(kernel.ops, case.split(":")[0]).default
    torch.library.opcheck(op, args)


@pytest.mark.kernels_ci
def test_every_op_is_opchecked(kernel):
    prefix = kernel.ops.name + "::"
    registered = {n[len(prefix):] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix)}
    checked = {name.split(":")[0] for name in _cases("cpu")}
    assert len(registered) >= 20, registered
    assert registered == checked, f"ops without an opcheck case: {registered - checked}"


def _model(k):
    def block(x, res, w, gate, scale, shift, q, kk, cos, sin, lcos, lsin, wq, wk):
        y, h = k.fused_add_rms_norm(x, res, w, 1e-6)
        y = k.rms_norm(y, w, 1e-6, weight_offset=1.0)
        h2, z = k.gated_residual_adaln(h, y, gate, scale, shift, 1e-6, norm="layer")
        z = k.adaln(z, scale, shift, 1e-6, norm="rms") + k.gated_residual(h2, z, gate)
        z = k.geglu(torch.cat([z, z], -1)) + k.gelu(z) + k.gelu_mul(z, z)
        q2, k2 = k.rope_rotate_half(q, kk, cos, sin)
        q3, k3 = k.rope_interleaved(q2, k2, cos, sin)
        lq, lk = k.qk_norm_rope(z, z * 2, wq, wk, lcos, lsin, 1e-5)
        return z.sum() + q3.sum() + k3.sum() + lq.sum() + lk.sum()
    return block


def _model_inputs(device):
    f = dict(device=device, dtype=torch.float32)
    return (torch.randn(2, 5, 64, **f), torch.randn(2, 5, 64, **f), torch.randn(64, **f), torch.randn(2, 64, **f),
            torch.randn(2, 1, 64, **f), torch.randn(2, 1, 64, **f), torch.randn(2, 4, 5, 32, **f),
            torch.randn(2, 2, 5, 32, **f), torch.randn(5, 32, **f), torch.randn(5, 32, **f),
            torch.randn(2, 5, 64, **f), torch.randn(2, 5, 64, **f), torch.randn(64, **f), torch.randn(64, **f))


@pytest.mark.kernels_ci
def test_compile_fullgraph_matches_eager_without_recompiles(kernel, device):
    import torch._dynamo

    torch._dynamo.reset()
    block = _model(kernel)
    compiled = torch.compile(block, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):  # new values, one shape: one compile
            inputs = _model_inputs(device)
            torch.testing.assert_close(compiled(*inputs), block(*inputs), rtol=1e-4, atol=1e-3)


@pytest.mark.kernels_ci
def test_compile_fullgraph_backward_matches_eager(kernel, device):
    """Training through torch.compile: AOT autograd traces the registered backward
    formulas (fake impls of the backward ops included) in one graph."""
    import torch._dynamo

    torch._dynamo.reset()
    block = _model(kernel)
    compiled = torch.compile(block, fullgraph=True)
    tables = {8, 9, 10, 11}  # cos, sin, lcos, lsin: constants
    inputs = [t if i in tables else t.requires_grad_() for i, t in enumerate(_model_inputs(device))]
    leaves = [t for i, t in enumerate(inputs) if i not in tables]
    got = torch.autograd.grad(compiled(*inputs), leaves)
    want = torch.autograd.grad(block(*inputs), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
