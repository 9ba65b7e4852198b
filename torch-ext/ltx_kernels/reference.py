"""The PyTorch code each op replaces, written as the host libraries write it (the cast
order included): what the benchmarks verify against and time as the eager and
torch.compile peers. The tests keep their own fp64 references (tests/reference.py)."""

import torch
import torch.nn.functional as F


def llama_rms_norm(x, weight, eps=1e-6):
    """transformers' LlamaRMSNorm: normalise in fp32, round to x's dtype, then weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def diffusers_rms_norm(x, eps=1e-6):
    """diffusers' RMSNorm without weight (LTX-Video's norm1/norm2): the product is
    promoted to fp32 by the fp32 rsqrt and rounded once."""
    h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype)


def adaln(norm):
    """LTX-Video's block modulate (``norm="rms"``) or DiT/LTX-final LayerNorm without
    affine (``norm="layer"``), then ``* (1 + scale) + shift``."""

    def run(x, scale, shift):
        normed = diffusers_rms_norm(x) if norm == "rms" else F.layer_norm(x, x.shape[-1:], eps=1e-6)
        return normed * (1 + scale) + shift

    return run


def adaln_with_torch_rms_norm(x, scale, shift):
    """The same RMS modulate written with ``F.rms_norm`` (one fused norm, no weight)."""
    return F.rms_norm(x, x.shape[-1:], None, 1e-6) * (1 + scale) + shift


def gated_residual_adaln(norm):
    """A DiT block boundary: ``h = residual + x * gate``, then the next norm's modulate."""
    modulate = adaln(norm)

    def run(residual, x, gate, scale, shift):
        h = residual + x * gate
        return h, modulate(h, scale, shift)

    return run


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def transformers_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1): q/k [B, H, S, D], cos/sin [B, S, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def ltx_rope_one(x, cos, sin):
    """diffusers' LTX-Video apply_rotary_emb: pairs (2i, 2i+1) of [B, S, C], fp32 tables."""
    real, imag = x.unflatten(2, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def ltx_rope(q, k, cos, sin):
    return ltx_rope_one(q, cos, sin), ltx_rope_one(k, cos, sin)


def ltx_qk_norm_rope(q, k, q_weight, k_weight, cos, sin):
    """LTX-Video's attention prologue: torch.nn.RMSNorm(2048, eps=1e-5) on q and k, then RoPE."""
    q = F.rms_norm(q, q.shape[-1:], q_weight, 1e-5)
    k = F.rms_norm(k, k.shape[-1:], k_weight, 1e-5)
    return ltx_rope(q, k, cos, sin)


def diffusers_geglu(x):
    """diffusers' GEGLU after its projection: the gate is the second half, exact GELU."""
    value, gate = x.chunk(2, dim=-1)
    return value * F.gelu(gate)


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def gemma_gelu_mul(gate, up):
    """Gemma's MLP activation: gelu_tanh(gate_proj(x)) * up_proj(x)."""
    return F.gelu(gate, approximate="tanh") * up
