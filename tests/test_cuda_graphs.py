"""CUDA graphs: every op, forward and backward, is capture-safe (no host sync, no
allocation outside the caching allocator, no CPU reads of device data). Each case is
captured once, then replayed on new input values and compared bit for bit with eager
calls on those values. GPU only."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA graphs need a GPU (these run on the device)", allow_module_level=True)


def _cases(k):
    """name -> (input factories, function of the inputs returning tensors); k is only
    touched when a function runs, so _cases(None) lists the names."""
    bf16 = torch.bfloat16

    def r(*shape, dtype=bf16):
        return lambda: torch.randn(*shape, device="cuda", dtype=dtype)

    x, w, mod, tok = r(4, 300, 256), r(256), r(4, 1, 256), r(4, 300, 256)
    q, kk, cos = r(2, 8, 64, 128), r(2, 2, 64, 128), r(64, 128, dtype=torch.float32)
    lq, lcos = r(2, 64, 512), r(2, 64, 512, dtype=torch.float32)
    # 2048 columns: rows on 64 threads, four to a block (68 KB of shared memory on the H200)
    wide, wide_mod = r(2, 301, 2048), r(2, 1, 2048)
    sliced = r(64, 20000)  # rows of three column slices: one cluster's blocks on sm_90
    return {
        "rms_norm": ([x, w], lambda x, w: k.rms_norm(x, w, 1e-6)),
        "fused_add_rms_norm": ([x, tok, w], lambda x, r, w: k.fused_add_rms_norm(x, r, w, 1e-6)),
        "adaln_rms": ([x, mod, mod], lambda x, s, t: k.adaln(x, s, t, 1e-6, norm="rms")),
        "adaln_layer_per_token": ([x, tok, tok], lambda x, s, t: k.adaln(x, s, t, 1e-6, norm="layer")),
        "gated_residual": ([tok, x, mod], lambda r, x, g: k.gated_residual(r, x, g)),
        "gated_residual_adaln": ([tok, x, mod, mod, mod],
                                 lambda r, x, g, s, t: k.gated_residual_adaln(r, x, g, s, t, 1e-6, norm="rms")),
        "rope_rotate_half": ([q, kk, cos, cos], lambda q, k_, c, s: k.rope_rotate_half(q, k_, c, s)),
        "rope_interleaved_inplace": ([lq, lq, lcos, lcos],
                                     lambda q, k_, c, s: k.rope_interleaved(q, k_, c, s, inplace=True)),
        "qk_norm_rope": ([lq, lq, r(512), r(512), lcos, lcos],
                         lambda q, k_, wq, wk, c, s: k.qk_norm_rope(q, k_, wq, wk, c, s, 1e-5)),
        "gelu": ([x], lambda x: k.gelu(x, "tanh")),
        "gelu_mul": ([x, x], lambda g, u: k.gelu_mul(g, u, "tanh")),
        "geglu": ([x], lambda x: k.geglu(x, "none")),
        "rms_norm_backward": ([x, x, w], lambda g, x, w: k.ops.rms_norm_backward(g, x, w, 1e-6, 0.0, False, None)),
        "adaln_backward": ([x, x, mod, mod], lambda g, x, s, t: k.ops.adaln_backward(g, x, s, t, 1e-6, "layer", None)),
        "rms_norm_backward_row_slices": ([sliced, sliced, r(20000)], lambda g, x, w:
                                         k.ops.rms_norm_backward(g, x, w, 1e-6, 0.0, False, None)),
        "adaln_backward_rows_sharing_a_block": ([wide, wide, wide_mod, wide_mod], lambda g, x, s, t:
                                                k.ops.adaln_backward(g, x, s, t, 1e-6, "rms", None)),
        "adaln_with_stats_and_backward": ([x, x, mod, mod], lambda g, x, s, t: _with_stats_backward(k, g, x, s, t)),
        "gated_residual_adaln_with_stats": ([tok, x, mod, mod, mod], lambda r, x, g, s, t:
                                            k.ops.gated_residual_adaln_with_stats(r, x, g, s, t, 1e-6, "layer")),
        "gated_residual_backward": ([x, x, mod], lambda g, x, gate: k.ops.gated_residual_backward(g, x, gate)),
        "gated_residual_adaln_backward": ([wide, wide, wide, wide, wide_mod, wide_mod, wide_mod],
                                          lambda g, gs, s, x, gate, sc, sh: k.ops.gated_residual_adaln_backward(
                                              g, gs, s, x, gate, sc, sh, 1e-6, "rms", None)),
        "rope_backward": ([q, kk, cos, cos], lambda gq, gk, c, s: k.ops.rope_backward(gq, gk, c, s, True, 2)),
        "gelu_backward": ([x, x], lambda g, x: k.ops.gelu_backward(g, x, "tanh")),
        "gelu_mul_backward": ([x, x, x], lambda g, a, b: k.ops.gelu_mul_backward(g, a, b, "none")),
        "geglu_backward": ([r(4, 300, 128), x], lambda g, x: k.ops.geglu_backward(g, x, "tanh")),
        # FP8 producers (sm_89+): q and the row scales
        "fp8_quantize": ([x], lambda x: k.quantize_fp8(x)),
        "fp8_rms_norm": ([x, w], lambda x, w: k.rms_norm_fp8(x, w, 1e-6)),
        "fp8_adaln": ([x, mod, mod], lambda x, s, t: k.adaln_fp8(x, s, t, 1e-6, norm="rms")),
        "fp8_gated_residual_adaln": ([tok, x, mod, mod, mod], lambda r, x, g, s, t:
                                     k.gated_residual_adaln_fp8(r, x, g, s, t, 1e-6, norm="layer")),
        "fp8_gelu": ([x], lambda x: k.gelu_fp8(x, "tanh")),
        "fp8_geglu": ([x], lambda x: k.geglu_fp8(x, "none")),
    }


def _with_stats_backward(k, grad, x, scale, shift):
    """The forward autograd calls for adaln, then its backward from the saved statistics."""
    out, stats = k.ops.adaln_with_stats(x, scale, shift, 1e-6, "layer")
    return (out, stats, *k.ops.adaln_backward(grad, x, scale, shift, 1e-6, "layer", None, stats))


def _bits(t):
    """FP8 tensors as their bytes (torch.equal compares numbers)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("case", sorted(_cases(None)))
def test_op_replays_on_new_values(kernel, device, case):
    if device != "cuda":
        pytest.skip("CUDA graphs capture CUDA tensors")
    if case.startswith("fp8_") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+")
    factories, fn = _cases(kernel)[case]
    static = [f() for f in factories]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture stream, as capture requires
        fn(*[t.clone() for t in static])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _as_tuple(fn(*static))
    for _ in range(2):
        fresh = [f() for f in factories]
        for s, v in zip(static, fresh):
            s.copy_(v)
        graph.replay()
        expected = _as_tuple(fn(*fresh))  # in-place cases rotate `fresh` itself
        for got, want in zip(captured, expected):
            assert torch.equal(_bits(got), _bits(want)), case


@pytest.mark.kernels_ci
def test_training_step_replays(kernel, device):
    """Forward and autograd backward captured together (whole-step capture)."""
    if device != "cuda":
        pytest.skip("CUDA graphs capture CUDA tensors")
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)

    def step():
        return torch.autograd.grad(kernel.gelu(kernel.rms_norm(x, w, 1e-6), "tanh"), (x, w), g)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        w.copy_(torch.randn_like(w))
        g.copy_(torch.randn_like(g))
    graph.replay()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)
