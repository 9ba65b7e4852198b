"""Each op against the actual transformers / diffusers code it replaces: tiny modules built
from their real classes (random weights, no downloads), same inputs, same outputs within
the roundings the two computations differ by."""

import pytest
import torch

from reference import TOLERANCE

transformers = pytest.importorskip("transformers", reason="requirements-dev.txt installs transformers")
diffusers = pytest.importorskip("diffusers", reason="requirements-dev.txt installs diffusers")

from diffusers.models.activations import GEGLU, GELU  # noqa: E402
from diffusers.models.embeddings import apply_rotary_emb as flux_apply_rotary_emb  # noqa: E402
from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero  # noqa: E402
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm  # noqa: E402
from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_apply_rotary_emb  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm  # noqa: E402

LOW = [torch.bfloat16, torch.float16]


def close(actual, expected, dtype, ulps=2, atol=None):
    """Within `ulps` units in the last place of `dtype` (the host rounds more often than
    the kernel, which rounds once in fp32)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape
    rtol = TOLERANCE[dtype]["rtol"] * ulps
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=rtol if atol is None else atol)


def modulated_atol(dtype):
    """The hosts modulate in the model dtype: norm, * (1 + scale) and + shift each round,
    at magnitudes up to ~8: a few ulps of that, absolute."""
    return 8 * TOLERANCE[dtype]["rtol"]


def randomised(module, device, dtype):
    module = module.to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("cls, shape", [(LlamaRMSNorm, (2, 9, 512)), (Qwen3RMSNorm, (2, 9, 4, 128))],
                         ids=["llama", "qwen3_per_head"])
def test_transformers_rmsnorm(kernel, device, cls, shape, dtype):
    host = randomised(cls(shape[-1], eps=1e-6), device, dtype)
    x = torch.randn(shape, device=device, dtype=dtype)
    y = kernel.layers.RMSNorm.forward(host, x)
    close(y, host(x), dtype)


def test_transformers_rmsnorm_fp32_weight_returns_fp32(kernel, device):
    """An fp32 module on bf16 activations: the host's promotion gives an fp32 result."""
    host = randomised(LlamaRMSNorm(256), device, torch.float32)
    x = torch.randn(5, 256, device=device, dtype=torch.bfloat16)
    y = kernel.layers.RMSNorm.forward(host, x)
    close(y, host(x), torch.bfloat16)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("cls", [GemmaRMSNorm, Qwen3_5RMSNorm], ids=["gemma", "qwen3_5"])
def test_zero_centred_rmsnorm(kernel, device, cls, dtype):
    host = randomised(cls(384, eps=1e-6), device, dtype)
    x = torch.randn(3, 7, 384, device=device, dtype=dtype)
    y = kernel.rms_norm(x, host.weight, host.eps, weight_offset=1.0)
    close(y, host(x), dtype)


@pytest.mark.parametrize("weight", ["bf16", "fp32", "none"])
def test_diffusers_rmsnorm(kernel, device, weight):
    affine = weight != "none"
    host = DiffusersRMSNorm(256, eps=1e-6, elementwise_affine=affine).to(device)
    if affine:
        with torch.no_grad():
            host.weight.normal_()
        host.to(torch.bfloat16 if weight == "bf16" else torch.float32)
    x = torch.randn(2, 11, 256, device=device, dtype=torch.bfloat16)
    expected = host(x)
    if weight == "bf16":  # the normed value is rounded to the weight's dtype first
        y = kernel.rms_norm(x, host.weight, 1e-6, cast_before_weight=True)
    elif weight == "fp32":  # fp32 math, fp32 result
        y = kernel.rms_norm(x, host.weight, 1e-6, out_dtype=torch.float32)
    else:
        y = kernel.rms_norm(x, None, 1e-6)
    close(y, expected, torch.bfloat16)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_transformers_apply_rotary_pos_emb(kernel, device, dtype):
    b, hq, hkv, s, d = 2, 8, 2, 33, 64
    q = torch.randn(b, s, hq, d, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, s, hkv, d, device=device, dtype=dtype).transpose(1, 2)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
    freqs = torch.arange(s, device=device).float()[:, None] * inv
    emb = torch.cat([freqs, freqs], -1)[None].expand(b, s, d)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    q_out, k_out = kernel.rope_rotate_half(q, k, cos, sin)
    close(q_out, q_ref, dtype, ulps=3)
    close(k_out, k_ref, dtype, ulps=3)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_ltx_apply_rotary_emb(kernel, device, dtype):
    b, s, c = 2, 40, 192
    q, k = (torch.randn(b, s, c, device=device, dtype=dtype) for _ in range(2))
    ang = torch.rand(b, s, c // 2, device=device) * 6.28
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    q_out, k_out = kernel.rope_interleaved(q, k, cos, sin)
    close(q_out, ltx_apply_rotary_emb(q, (cos, sin)), dtype)
    close(k_out, ltx_apply_rotary_emb(k, (cos, sin)), dtype)


@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_flux_apply_rotary_emb(kernel, device, sequence_dim):
    b, s, h, d = 1, 24, 3, 128
    shape = (b, s, h, d) if sequence_dim == 1 else (b, h, s, d)
    q, k = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(2))
    ang = torch.rand(s, d // 2, device=device) * 6.28
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    q_out, _ = kernel.rope_interleaved(q, k, cos, sin, sequence_dim=sequence_dim)
    close(q_out, flux_apply_rotary_emb(q, (cos, sin), sequence_dim=sequence_dim), torch.bfloat16)


def test_ltx_attention_prologue(kernel, device):
    """norm_q / norm_k as LTX builds them (torch.nn.RMSNorm over all heads, eps 1e-5), then
    its apply_rotary_emb."""
    b, s, c = 2, 16, 256
    dtype = torch.bfloat16
    norm_q = randomised(torch.nn.RMSNorm(c, eps=1e-5), device, dtype)
    norm_k = randomised(torch.nn.RMSNorm(c, eps=1e-5), device, dtype)
    q, k = (torch.randn(b, s, c, device=device, dtype=dtype) for _ in range(2))
    ang = torch.rand(b, s, c // 2, device=device) * 6.28
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    q_out, k_out = kernel.qk_norm_rope(q, k, norm_q.weight, norm_k.weight, cos, sin, 1e-5)
    # Rounding ties of the normed value show where the rotation terms cancel (see test_rope).
    close(q_out, ltx_apply_rotary_emb(norm_q(q), (cos, sin)), dtype, ulps=3, atol=4 * TOLERANCE[dtype]["rtol"])
    close(k_out, ltx_apply_rotary_emb(norm_k(k), (cos, sin)), dtype, ulps=3, atol=4 * TOLERANCE[dtype]["rtol"])


def test_diffusers_geglu(kernel, device):
    """SD UNets' GEGLU (exact erf GELU; the gate is the second half of the projection)."""
    host = randomised(GEGLU(64, 96), device, torch.bfloat16)
    x = torch.randn(3, 10, 64, device=device, dtype=torch.bfloat16)
    close(kernel.geglu(host.proj(x), "none"), host(x), torch.bfloat16, ulps=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layer", ["GEGLU", "DiffusersGELU-none", "DiffusersGELU-tanh"])
def test_exact_gelu_layers_hand_cpu_fp32_to_the_host(kernel, device, layer, dtype, monkeypatch):
    """The exact-GELU layers hand fp32 CPU tensors to the host's forward (PyTorch's erf GELU
    is level with the twin there) and run our op otherwise; the tanh form runs our op
    everywhere but in 16 bits on CUDA, where the GELU runs in the projection GEMM's epilogue
    (test_diffusers_gelu_layer)."""
    calls = []
    for name in ("geglu", "gelu"):
        op = getattr(kernel.layers, name)
        monkeypatch.setattr(kernel.layers, name, lambda *a, _op=op, **k: calls.append(1) or _op(*a, **k))
    if layer == "GEGLU":
        host, forward = GEGLU(64, 96), kernel.layers.GEGLU.forward
    else:
        host, forward = GELU(64, 96, approximate=layer.split("-")[1]), kernel.layers.DiffusersGELU.forward
    host = randomised(host, device, dtype)
    x = torch.randn(3, 10, 64, device=device, dtype=dtype)
    with torch.no_grad():
        y = forward(host, x)
        expected = host(x)
    on_host = device == "cpu" and dtype == torch.float32 and not layer.endswith("tanh")
    in_epilogue = device == "cuda" and dtype != torch.float32 and layer.endswith("tanh")
    assert bool(calls) == (not on_host and not in_epilogue)
    if on_host:
        assert torch.equal(y, expected)
    else:
        close(y, expected, dtype, ulps=3)


def test_diffusers_gelu_tanh(kernel, device):
    host = randomised(GELU(64, 128, approximate="tanh"), device, torch.bfloat16)
    x = torch.randn(3, 10, 64, device=device, dtype=torch.bfloat16)
    close(kernel.gelu(host.proj(x), "tanh"), host(x), torch.bfloat16)


@pytest.fixture
def epilogue_calls(monkeypatch):
    """One entry per call of torch._addmm_activation (the GEMM with a GELU epilogue)."""
    calls = []
    addmm_activation = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation",
                        lambda *args, **kwargs: calls.append(1) or addmm_activation(*args, **kwargs))
    return calls


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_diffusers_gelu_layer(kernel, device, approximate, dtype, grad, epilogue_calls):
    """diffusers' GELU module (LTX, FLUX, SD3 feed-forwards): on CUDA, tanh, 16 bits and no
    grad, a GEMM epilogue that rounds once where the host rounds the projection and the
    GELU; otherwise the projection and our gelu of the host's form, differentiable."""
    host = randomised(GELU(64, 96, approximate=approximate), device, dtype)
    x = torch.randn(3, 10, 64, device=device, dtype=dtype, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        y = kernel.layers.DiffusersGELU.forward(host, x)
        expected = host(x)
    assert bool(epilogue_calls) == (device == "cuda" and approximate == "tanh" and dtype != torch.float32
                                    and not grad)
    # |proj(x)| up to ~20 here: a few ulps of that, absolute (fp32: the two GEMMs' orders).
    close(y, expected, dtype, ulps=3, atol=16 * TOLERANCE[dtype]["rtol"] if dtype != torch.float32 else 1e-4)
    if dtype == torch.float32:  # the form: erf and tanh GELU differ by up to 4.7e-4
        exact = torch.nn.functional.gelu(host.proj(x).double(), approximate=approximate)
        torch.testing.assert_close(y.double(), exact, rtol=1e-6, atol=1e-5)
    if grad:
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, host.proj.weight], dy)
        want = torch.autograd.grad(expected, [x, host.proj.weight], dy)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), rtol=4 * TOLERANCE[dtype]["rtol"],
                                       atol=4 * TOLERANCE[dtype]["rtol"] * w.abs().max().item())


def test_diffusers_gelu_layer_calls_a_wrapped_projection(kernel, device, epilogue_calls):
    """A projection with a forward hook (as LoRA, offload and quantization wrappers work)
    is called, not read around: no GEMM epilogue then, on CUDA either."""
    host = randomised(GELU(64, 96, approximate="tanh"), device, torch.bfloat16)
    host.proj.register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(3, 10, 64, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        y = kernel.layers.DiffusersGELU.forward(host, x)
        expected = host(x)
    assert not epilogue_calls
    close(y, expected, torch.bfloat16, ulps=3, atol=32 * TOLERANCE[torch.bfloat16]["rtol"])


def test_gemma_mlp_activation(kernel, device):
    act = ACT2FN["gelu_pytorch_tanh"]
    gate, up = (torch.randn(4, 300, device=device, dtype=torch.bfloat16) for _ in range(2))
    close(kernel.gelu_mul(gate, up, "tanh"), act(gate) * up, torch.bfloat16, ulps=3)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_ada_layer_norm_zero(kernel, device, dtype):
    """DiT / FLUX: emb -> 6 chunks (shift first); x = norm(x) * (1 + scale) + shift."""
    d = 128
    host = randomised(AdaLayerNormZero(d), device, dtype)
    x = torch.randn(2, 20, d, device=device, dtype=dtype)
    emb = torch.randn(2, d, device=device, dtype=dtype)
    expected, gate_msa, shift_mlp, scale_mlp, gate_mlp = host(x, emb=emb)
    shift, scale = host.linear(host.silu(emb)).chunk(6, dim=1)[:2]
    close(kernel.adaln(x, scale, shift, 1e-6, norm="layer"), expected, dtype, ulps=3, atol=modulated_atol(dtype))


def test_ada_layer_norm_continuous(kernel, device):
    """SD3 / FLUX final norm: chunks scale before shift."""
    d = 96
    host = randomised(AdaLayerNormContinuous(d, d, elementwise_affine=False, eps=1e-6), device, torch.bfloat16)
    x = torch.randn(2, 13, d, device=device, dtype=torch.bfloat16)
    cond = torch.randn(2, d, device=device, dtype=torch.bfloat16)
    scale, shift = host.linear(host.silu(cond).to(x.dtype)).chunk(2, dim=1)
    close(kernel.adaln(x, scale, shift, 1e-6, norm="layer"), host(x, cond), torch.bfloat16, ulps=3,
          atol=modulated_atol(torch.bfloat16))


def test_ltx_block_norm_modulate_and_gated_residual(kernel, device):
    """LTX block: norm1 (RMSNorm, no weight) * (1 + scale_msa) + shift_msa with
    scale_shift_table + temb, and the residual x + attn * gate_msa, fused."""
    b, s, d = 2, 24, 128
    dtype = torch.bfloat16
    table = torch.randn(6, d, device=device, dtype=dtype) / d**0.5
    temb = torch.randn(b, 1, 6 * d, device=device, dtype=dtype)
    ada = table[None, None] + temb.reshape(b, 1, 6, d)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada.unbind(dim=2)
    norm1 = DiffusersRMSNorm(d, eps=1e-6, elementwise_affine=False)
    x = torch.randn(b, s, d, device=device, dtype=dtype)
    attn = torch.randn(b, s, d, device=device, dtype=dtype)

    close(kernel.adaln(x, scale_msa, shift_msa, 1e-6, norm="rms"),
          norm1(x) * (1 + scale_msa) + shift_msa, dtype, ulps=3, atol=modulated_atol(dtype))

    h_ref = x + attn * gate_msa
    h, y = kernel.gated_residual_adaln(x, attn, gate_msa, scale_mlp, shift_mlp, 1e-6, norm="rms")
    close(h, h_ref, dtype)
    close(y, norm1(h) * (1 + scale_mlp) + shift_mlp, dtype, ulps=3, atol=modulated_atol(dtype))
