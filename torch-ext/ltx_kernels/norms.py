"""Normalisation ops: the functional API over the compiled ops, with their fake
(meta) implementations for torch.compile beside them."""

from typing import Optional

import torch

from ._ops import add_op_namespace_prefix, ops


def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x**2, -1) + eps) * weight``.

    Computed in fp32 and rounded once to ``x.dtype`` (as ``F.rms_norm``).

    Args:
        x: ``[..., D]`` float32, float16 or bfloat16, on CPU or CUDA. The last dim must
            be contiguous and the leading dims must collapse into one row stride
            (contiguous tensors and slices such as ``qkv[..., :D]`` qualify).
        weight: optional ``[D]``, same dtype and device as ``x``.
        eps: added to the mean square, >= 0.
        out: optional output with ``x``'s sizes and dtype (may be ``x`` itself).

    Returns:
        ``out`` if given, else a new contiguous tensor shaped like ``x``.
    """
    if out is None:
        return ops.rms_norm(x, weight, eps)
    ops.rms_norm_out(out, x, weight, eps)
    return out


@torch.library.register_fake(add_op_namespace_prefix("rms_norm"))
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake(add_op_namespace_prefix("rms_norm_out"))
def _rms_norm_out_fake(out, x, weight, eps):
    return None
