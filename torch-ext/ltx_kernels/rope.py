"""Rotary position embeddings for q and k in one launch, with fake implementations for
torch.compile beside them.

q and k: ``[B, S, C]`` (LTX-Video), ``[B, H, S, D]`` (transformers, FLUX) or
``[B, S, H, D]`` (pass ``sequence_dim=1``), any strides with a contiguous last dim
(transposed views work), k may have fewer heads (GQA); fp32, fp16 or bf16. cos and sin:
``[S, R]`` or ``[B, S, R]``, in q's dtype or float32; only the first R channels rotate
(partial rotary), the rest pass through. fp32 math, one rounding.
"""

from typing import Tuple

import torch

from ._ops import add_op_namespace_prefix, ops


def rope_rotate_half(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, sequence_dim: int = 2,
    inplace: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin`` where
    channel i < R/2 pairs with i + R/2. Returns new (q, k) in q's and k's layouts, or
    rotates q and k in place."""
    return _rope(q, k, cos, sin, False, sequence_dim, inplace)


def rope_interleaved(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, sequence_dim: int = 2,
    inplace: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``apply_rotary_emb`` with real cos/sin (LTX-Video on ``[B, S, C]`` with
    fp32 ``[B, S, C]`` tables; FLUX per head with fp32 ``[S, D]`` tables): channels
    (2i, 2i+1) rotate as a pair."""
    return _rope(q, k, cos, sin, True, sequence_dim, inplace)


def _rope(q, k, cos, sin, interleaved, sequence_dim, inplace):
    if inplace:
        ops.rope_(q, k, cos, sin, interleaved, sequence_dim)
        return q, k
    return ops.rope(q, k, cos, sin, interleaved, sequence_dim)


@torch.library.register_fake(add_op_namespace_prefix("rope"))
def _(q, k, cos, sin, interleaved, sequence_dim):
    return torch.empty_like(q), torch.empty_like(k)


for _name in ("rope_out", "rope_"):
    torch.library.register_fake(add_op_namespace_prefix(_name))(lambda *args: None)
del _name
