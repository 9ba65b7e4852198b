"""Rotary position embeddings for q and k in one launch, with fake implementations for
torch.compile beside them.

q and k: ``[B, S, C]`` (LTX-Video), ``[B, H, S, D]`` (transformers, FLUX) or
``[B, S, H, D]`` (pass ``sequence_dim=1``; the default is 2 for 4-D q and 1, the only
value, for 3-D q), any strides with a contiguous last dim
(transposed views work), k may have fewer heads (GQA); fp32, fp16 or bf16. cos and sin:
``[S, R]`` or ``[B, S, R]``, in q's dtype or float32; only the first R channels rotate
(partial rotary), the rest pass through. fp32 math, one rounding. On the CPU also
float64 (q, k and the tables), in double.

Autograd: the functional forms are differentiable in q and k (the backward is the same
kernel rotating the other way; qk_norm_rope also in its weights). The tables are
constants: a cos or sin that requires grad is refused at backward time. Double backward
and forward-mode AD raise, as do ``inplace=True`` and ``out=`` on tensors that require grad.
"""

from typing import Optional, Tuple

import torch

from . import _checks as checks
from ._args import check_not_bool
from ._ops import ops
from ._checks import DENSE_ADVICE, refuses_nested, register_fake


@refuses_nested("rope_rotate_half", DENSE_ADVICE)
def rope_rotate_half(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, sequence_dim: Optional[int] = None,
    inplace: bool = False, out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin`` where
    channel i < R/2 pairs with i + R/2. Returns new (q, k) in q's and k's layouts, rotates
    q and k in place, or writes ``out=(q_out, k_out)`` (q's and k's sizes and dtype, any
    strides with a contiguous last dim; no allocation, for decode loops)."""
    return _rope(q, k, cos, sin, False, sequence_dim, inplace, out)


@refuses_nested("rope_interleaved", DENSE_ADVICE)
def rope_interleaved(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, sequence_dim: Optional[int] = None,
    inplace: bool = False, out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``apply_rotary_emb`` with real cos/sin (LTX-Video on ``[B, S, C]`` with
    fp32 ``[B, S, C]`` tables; FLUX per head with fp32 ``[S, D]`` tables): channels
    (2i, 2i+1) rotate as a pair. ``inplace`` and ``out`` as in :func:`rope_rotate_half`."""
    return _rope(q, k, cos, sin, True, sequence_dim, inplace, out)


@refuses_nested("qk_norm_rope", DENSE_ADVICE)
def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-5,
    *,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The LTX-Video attention prologue in one launch: ``norm_q(q)`` and ``norm_k(k)``
    (``torch.nn.RMSNorm`` over all C channels, across heads, with weights ``[C]``), each
    rounded to q's dtype as that module returns, then :func:`rope_interleaved` with
    ``[B, S, C]`` (or ``[S, C]``) tables. q and k: ``[B, S, C]`` with rows of one stride
    (slices of a fused qkv projection work); C even, at most 16384 (bf16/fp16) or 8192
    (fp32) on CUDA (4096 for views not 16-byte aligned). ``out=(q_out, k_out)`` may be
    ``(q, k)``."""
    check_not_bool("qk_norm_rope", eps=eps)
    if out is None:
        return ops.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)
    q_out, k_out = _output_pair(out, "qk_norm_rope")
    ops.qk_norm_rope_out(q_out, k_out, q, k, q_weight, k_weight, cos, sin, eps)
    return q_out, k_out


def _output_pair(out, op: str) -> Tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(f"{op}: out must be a pair (q_out, k_out)")
    if not all(isinstance(t, torch.Tensor) for t in out):
        raise TypeError(f"{op}: out must be a pair of tensors (q_out, k_out), got "
                        f"({', '.join(type(t).__name__ for t in out)})")
    return out[0], out[1]


def _rope(q, k, cos, sin, interleaved, sequence_dim, inplace, out):
    if inplace and out is not None:
        raise ValueError("rope: pass inplace=True or out=, not both")
    if sequence_dim is None:  # [B, S, C] has its sequence in dim 1, [B, H, S, D] in dim 2
        sequence_dim = 1 if isinstance(q, torch.Tensor) and q.dim() == 3 else 2
    check_not_bool("rope", sequence_dim=sequence_dim)
    if inplace:
        ops.rope_(q, k, cos, sin, interleaved, sequence_dim)
        return q, k
    if out is not None:
        q_out, k_out = _output_pair(out, "rope")
        ops.rope_out(q_out, k_out, q, k, cos, sin, interleaved, sequence_dim)
        return q_out, k_out
    return ops.rope(q, k, cos, sin, interleaved, sequence_dim)


# Fake implementations, for torch.compile, FakeTensorMode and meta tensors: the C++ checks
# (._checks, same messages), then the outputs' metadata.


@register_fake("rope")
def _(device, q, k, cos, sin, interleaved, sequence_dim):
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)  # q's and k's layouts
    checks.rope_apply(device, q_out, k_out, q, k, cos, sin, sequence_dim)
    return q_out, k_out


@register_fake("rope_out")
def _(device, q_out, k_out, q, k, cos, sin, interleaved, sequence_dim):
    checks.rope_apply(device, q_out, k_out, q, k, cos, sin, sequence_dim)


@register_fake("rope_")
def _(device, q, k, cos, sin, interleaved, sequence_dim):
    checks.rope_apply(device, q, k, q, k, cos, sin, sequence_dim)


@register_fake("rope_backward")
def _(device, grad_q, grad_k, cos, sin, interleaved, sequence_dim):
    grad_q_in, grad_k_in = torch.empty_like(grad_q), torch.empty_like(grad_k)
    checks.rope_apply(device, grad_q_in, grad_k_in, grad_q, grad_k, cos, sin, sequence_dim, inverse=True)
    return grad_q_in, grad_k_in


@register_fake("qk_norm_rope")
def _(device, q, k, q_weight, k_weight, cos, sin, eps):
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    checks.qk_norm_rope_out(device, q_out, k_out, q, k, q_weight, k_weight, cos, sin, eps)
    return q_out, k_out


@register_fake("qk_norm_rope_out")
def _(device, q_out, k_out, q, k, q_weight, k_weight, cos, sin, eps):
    checks.qk_norm_rope_out(device, q_out, k_out, q, k, q_weight, k_weight, cos, sin, eps)
