"""The norm family: the functional API over the compiled ops, with their fake (meta)
implementations for torch.compile beside them (their autograd is C++:
torch-ext/torch_autograd.cpp).

Shared rules: tensors are float32, float16 or bfloat16 on one device (CPU or CUDA), or
all float64 on the CPU (computed in double, for gradcheck); the
input is ``[..., D]`` with a contiguous last dim and leading dims that collapse into one
row stride (contiguous tensors and slices such as ``qkv[..., :D]``); sums and norms are
computed in fp32 and every output is rounded once. Outputs are new contiguous tensors,
or the ``out=`` tensors given (same sizes as the input; they may be the inputs).

Autograd: the functional forms (not ``out=``) are differentiable in every input tensor;
AdaLN's forward then also stores each row's mean and rstd (8 bytes a row) for its backward,
while RMSNorm's backward recomputes them. Weight, scale, shift and gate grads are reduced
in fp32 in a fixed order (deterministic). Double backward and forward-mode AD raise. The
``out=`` forms raise while grad mode is on and any tensor of the call requires grad.
"""

from typing import Optional, Tuple

import torch

from . import _checks as checks
from ._args import check_not_bool
from ._ops import ops
from ._checks import DENSE_ADVICE, ROWS_ADVICE, refuses_nested, register_fake

NORMS = ("rms", "layer")


@refuses_nested("rms_norm", ROWS_ADVICE)
def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x**2, -1) + eps) * (weight_offset + weight)``.

    Args:
        x: ``[..., D]``.
        weight: ``[D]`` of ``x``'s dtype, or float32 with fp16/bf16 ``x``; or ``None``.
        eps: added to the mean square, >= 0.
        weight_offset: 1.0 for zero-centred weights (Gemma, Qwen3.5: ``1 + weight``).
        cast_before_weight: round the normed value to ``x.dtype`` before the weight
            multiply (transformers' Llama order); by default one rounding at the end
            (``F.rms_norm``, Gemma).
        out_dtype: ``x.dtype`` (default) or float32 (fp32 weight only: what the Llama
            order returns for an fp32 weight).
        out: optional output of ``x``'s sizes; its dtype then sets the output dtype.
    """
    check_not_bool("rms_norm", eps=eps, weight_offset=weight_offset)
    if out is None:
        return ops.rms_norm(x, weight, eps, weight_offset, cast_before_weight, out_dtype)
    ops.rms_norm_out(out, x, weight, eps, weight_offset, cast_before_weight)
    return out


@refuses_nested("fused_add_rms_norm", ROWS_ADVICE)
def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (rounded to ``x.dtype``, as the hosts add), then
    ``(rms_norm(h, weight, eps, ...), h)``. ``residual`` has ``x``'s sizes and dtype.
    ``out`` and ``residual_out`` come together; they may be ``x`` and ``residual``
    (in place)."""
    check_not_bool("fused_add_rms_norm", eps=eps, weight_offset=weight_offset)
    if (out is None) != (residual_out is None):
        raise ValueError("fused_add_rms_norm: pass out and residual_out together, or neither")
    if out is None:
        return ops.fused_add_rms_norm(x, residual, weight, eps, weight_offset, cast_before_weight)
    ops.fused_add_rms_norm_out(out, residual_out, x, residual, weight, eps, weight_offset, cast_before_weight)
    return out, residual_out


@refuses_nested("adaln", DENSE_ADVICE)
def adaln(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
    *,
    norm: str = "layer",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Adaptive norm: ``norm(x) * (1 + scale) + shift``.

    Args:
        x: ``[B, S, D]`` or ``[B, D]``.
        scale, shift: ``[D]``, ``[B, D]``, ``[B, 1, D]`` or ``[B, S, D]`` (per token), of
            ``x``'s dtype with a contiguous last dim; other strides are fine (views from
            ``emb.chunk(6, dim=-1)`` need no copy).
        norm: ``"layer"`` (LayerNorm without affine: FLUX, SD3, DiT, LTX's final norm) or
            ``"rms"`` (LTX-Video blocks).
    """
    _check_norm(norm)
    check_not_bool("adaln", eps=eps)
    if out is None:
        return ops.adaln(x, scale, shift, eps, norm)
    ops.adaln_out(out, x, scale, shift, eps, norm)
    return out


@refuses_nested("gated_residual", DENSE_ADVICE)
def gated_residual(
    residual: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, *, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The DiT gated residual ``residual + x * gate``; ``gate`` broadcasts as ``scale``
    does in :func:`adaln`."""
    if out is None:
        return ops.gated_residual(residual, x, gate)
    ops.gated_residual_out(out, residual, x, gate)
    return out


@refuses_nested("gated_residual_adaln", DENSE_ADVICE)
def gated_residual_adaln(
    residual: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
    *,
    norm: str = "layer",
    residual_out: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One pass for the block boundary of a DiT: ``h = residual + x * gate`` and
    ``adaln(h, scale, shift, eps, norm=norm)``. Returns ``(h, modulated)``."""
    _check_norm(norm)
    check_not_bool("gated_residual_adaln", eps=eps)
    if (out is None) != (residual_out is None):
        raise ValueError("gated_residual_adaln: pass out and residual_out together, or neither")
    if out is None:
        return ops.gated_residual_adaln(residual, x, gate, scale, shift, eps, norm)
    ops.gated_residual_adaln_out(residual_out, out, residual, x, gate, scale, shift, eps, norm)
    return residual_out, out


def _check_norm(norm: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")


# Fake implementations, for torch.compile, FakeTensorMode and meta tensors: the C++ checks
# (._checks, same messages), then the outputs' metadata.


def _empty_rows_like(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return torch.empty_like(x, dtype=dtype or x.dtype, memory_format=torch.contiguous_format)


def _empty_stats(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], 2), dtype=torch.float32)


def _empty_grad_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


@register_fake("rms_norm")
def _(device, x, weight, eps, weight_offset, cast_before_weight, out_dtype):
    out = _empty_rows_like(x, out_dtype)
    checks.rms_norm_out(device, out, x, weight, eps)
    return out


@register_fake("rms_norm_out")
def _(device, out, x, weight, eps, weight_offset, cast_before_weight):
    checks.rms_norm_out(device, out, x, weight, eps)


@register_fake("fused_add_rms_norm")
def _(device, x, residual, weight, eps, weight_offset, cast_before_weight):
    out, residual_out = _empty_rows_like(x), _empty_rows_like(x)
    checks.fused_add_rms_norm_out(device, out, residual_out, x, residual, weight, eps)
    return out, residual_out


@register_fake("fused_add_rms_norm_out")
def _(device, out, residual_out, x, residual, weight, eps, weight_offset, cast_before_weight):
    checks.fused_add_rms_norm_out(device, out, residual_out, x, residual, weight, eps)


@register_fake("adaln")
def _(device, x, scale, shift, eps, norm):
    out = _empty_rows_like(x)
    checks.adaln_out(device, out, x, scale, shift, eps, norm)
    return out


@register_fake("adaln_out")
def _(device, out, x, scale, shift, eps, norm):
    checks.adaln_out(device, out, x, scale, shift, eps, norm)


@register_fake("adaln_with_stats")
def _(device, x, scale, shift, eps, norm):
    out = _empty_rows_like(x)
    checks.adaln_out(device, out, x, scale, shift, eps, norm)
    return out, _empty_stats(x)


@register_fake("gated_residual")
def _(device, residual, x, gate):
    residual_out = _empty_rows_like(x)
    checks.gated_residual_out(device, residual_out, None, residual, x, gate)
    return residual_out


@register_fake("gated_residual_out")
def _(device, residual_out, residual, x, gate):
    checks.gated_residual_out(device, residual_out, None, residual, x, gate)


@register_fake("gated_residual_adaln")
def _(device, residual, x, gate, scale, shift, eps, norm):
    residual_out, out = _empty_rows_like(x), _empty_rows_like(x)
    checks.gated_residual_out(device, residual_out, out, residual, x, gate, scale, shift, eps, norm)
    return residual_out, out


@register_fake("gated_residual_adaln_out")
def _(device, residual_out, out, residual, x, gate, scale, shift, eps, norm):
    checks.gated_residual_out(device, residual_out, out, residual, x, gate, scale, shift, eps, norm)


@register_fake("gated_residual_adaln_with_stats")
def _(device, residual, x, gate, scale, shift, eps, norm):
    residual_out, out = _empty_rows_like(x), _empty_rows_like(x)
    checks.gated_residual_out(device, residual_out, out, residual, x, gate, scale, shift, eps, norm)
    return residual_out, out, _empty_stats(x)


@register_fake("rms_norm_backward")
def _(device, grad_out, x, weight, eps, weight_offset, cast_before_weight, grad_extra):
    checks.rms_norm_backward(device, grad_out, x, weight, eps, grad_extra)
    return _empty_rows_like(x), x.new_empty(0) if weight is None else _empty_grad_like(weight)


@register_fake("adaln_backward")
def _(device, grad_out, x, scale, shift, eps, norm, grad_extra, stats=None):
    checks.adaln_backward(device, grad_out, x, scale, shift, eps, norm, grad_extra, stats)
    return _empty_rows_like(x), _empty_grad_like(scale), _empty_grad_like(shift)


@register_fake("gated_residual_backward")
def _(device, grad_out, x, gate):
    checks.gated_residual_backward(device, grad_out, x, gate)
    return _empty_rows_like(x), _empty_grad_like(gate)


@register_fake("gated_residual_adaln_backward")
def _(device, grad_out, grad_residual_out, residual_out, x, gate, scale, shift, eps, norm, stats=None):
    checks.gated_residual_adaln_backward(device, grad_out, grad_residual_out, residual_out, x, gate, scale, shift,
                                         eps, norm, stats)
    return (_empty_rows_like(x), _empty_rows_like(x), *(_empty_grad_like(t) for t in (gate, scale, shift)))
