"""FP8 producers for ``torch._scaled_mm`` with row-wise scales: ops that compute a row's fp32
result and write it as ``float8_e4m3fn`` with its fp32 scale, in one op, with their fake
(meta) implementations for torch.compile beside them. The norms (`rms_norm_fp8`,
`adaln_fp8`, `gated_residual_adaln_fp8`) feed attention and feed-forward input projections;
the GELU family (`gelu_fp8`, `gelu_mul_fp8`, `geglu_fp8`) feeds feed-forward output
projections; `quantize_fp8` takes any other GEMM input (the attention output).

The math, the same on CPU and CUDA: with ``y`` the op's fp32 row, ``scale = max(amax, 1e-12)
/ 448`` (``amax = max |y|``, NaN when the row holds a NaN) and ``q = float8_e4m3fn(clamp(y /
scale, -448, 448))``, rounded to nearest even, NaN staying NaN. With a static ``scale`` (one
fp32 element, for the whole tensor) that scale divides every row instead.

Inputs are float32, float16 or bfloat16 (no float64: FP8 has no float64 meaning), ``[..., D]``
with a contiguous last dim and leading dims that collapse into one row stride. On CUDA the
GPU must be of compute capability 8.9 or newer (FP8 GEMMs need it). Returns ``(q, scales)``:
``q`` contiguous of the input's sizes, ``scales`` fp32 ``x.shape[:-1] + (1,)`` (what
``torch._scaled_mm`` takes as ``scale_a`` after ``q.reshape(-1, D)``, ``scales.reshape(-1,
1)``), or the static scale given. No derivative: a call that autograd would record raises.
"""

from typing import Optional, Tuple

import torch

from . import _checks as checks
from ._args import check_not_bool
from ._checks import DENSE_ADVICE, ROWS_ADVICE, refuses_nested, register_fake
from ._ops import ops
from .norms import _check_norm


@refuses_nested("quantize_fp8", ROWS_ADVICE)
def quantize_fp8(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` as FP8 rows: ``(q, scales)`` with a scale per row, or ``(q, scale)`` with the
    static ``scale`` given (a one-element float32 tensor on ``x``'s device)."""
    if scale is None:
        return ops.quantize_fp8(x)
    return ops.quantize_fp8_static(x, scale), scale


@refuses_nested("rms_norm_fp8", ROWS_ADVICE)
def rms_norm_fp8(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`~ltx_kernels.rms_norm` written as FP8: its fp32 result, the value
    ``rms_norm(x, weight.float(), eps, ..., out_dtype=torch.float32)`` returns (with
    ``cast_before_weight`` the normed value is rounded to ``x.dtype`` before the weight, as
    there), quantized per row or by the static ``scale``. ``weight`` is ``[D]`` of ``x``'s
    dtype or float32, or ``None``."""
    check_not_bool("rms_norm_fp8", eps=eps, weight_offset=weight_offset)
    if scale is None:
        return ops.rms_norm_fp8(x, weight, eps, weight_offset, cast_before_weight)
    return ops.rms_norm_fp8_static(x, weight, eps, weight_offset, cast_before_weight, scale), scale


@refuses_nested("adaln_fp8", DENSE_ADVICE)
def adaln_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
    *,
    norm: str = "layer",
    fp8_scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`~ltx_kernels.adaln` written as FP8: ``norm(x) * (1 + scale) + shift`` in fp32
    (the value adaln rounds to ``x.dtype`` once), quantized per row or by the static
    ``fp8_scale``. Arguments as adaln's."""
    _check_norm(norm)
    check_not_bool("adaln_fp8", eps=eps)
    if fp8_scale is None:
        return ops.adaln_fp8(x, scale, shift, eps, norm)
    return ops.adaln_fp8_static(x, scale, shift, eps, norm, fp8_scale), fp8_scale


@refuses_nested("gated_residual_adaln_fp8", DENSE_ADVICE)
def gated_residual_adaln_fp8(
    residual: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
    *,
    norm: str = "layer",
    fp8_scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~ltx_kernels.gated_residual_adaln` with its modulated output written as FP8:
    ``h = residual + x * gate`` in ``x``'s dtype (as there), and ``norm(h) * (1 + scale) +
    shift`` in fp32 (the value gated_residual_adaln rounds to ``x.dtype``), quantized per
    row or by the static ``fp8_scale``. Returns ``(h, q, scales)``; arguments as
    gated_residual_adaln's."""
    _check_norm(norm)
    check_not_bool("gated_residual_adaln_fp8", eps=eps)
    if fp8_scale is None:
        return ops.gated_residual_adaln_fp8(residual, x, gate, scale, shift, eps, norm)
    h, q = ops.gated_residual_adaln_fp8_static(residual, x, gate, scale, shift, eps, norm, fp8_scale)
    return h, q, fp8_scale


@refuses_nested("gelu_fp8", ROWS_ADVICE)
def gelu_fp8(x: torch.Tensor, approximate: str = "tanh", *,
             scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`~ltx_kernels.gelu` written as FP8: ``gelu(x)`` in fp32 (the value gelu rounds
    to ``x.dtype``), quantized per row or by the static ``scale``."""
    if scale is None:
        return ops.gelu_fp8(x, approximate)
    return ops.gelu_fp8_static(x, approximate, scale), scale


@refuses_nested("gelu_mul_fp8", ROWS_ADVICE)
def gelu_mul_fp8(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *,
                 scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`~ltx_kernels.gelu_mul` written as FP8: ``gelu(gate) * up`` in fp32, quantized
    per row or by the static ``scale``."""
    if scale is None:
        return ops.gelu_mul_fp8(gate, up, approximate)
    return ops.gelu_mul_fp8_static(gate, up, approximate, scale), scale


@refuses_nested("geglu_fp8", ROWS_ADVICE)
def geglu_fp8(x: torch.Tensor, approximate: str = "none", *,
              scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`~ltx_kernels.geglu` written as FP8: ``x[..., :H] * gelu(x[..., H:])`` in fp32,
    quantized per row (rows of H) or by the static ``scale``."""
    if scale is None:
        return ops.geglu_fp8(x, approximate)
    return ops.geglu_fp8_static(x, approximate, scale), scale


# Fake implementations, for torch.compile, FakeTensorMode and meta tensors: the C++ checks
# (._checks, same messages), then the outputs' metadata.


def _outputs(x: torch.Tensor, dynamic: bool):
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if not dynamic:
        return q
    return q, torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)


@register_fake("quantize_fp8")
def _(device, x):
    checks.fp8_input(device, x, "quantize_fp8")
    checks.row_view(x, "quantize_fp8", "input")
    return _outputs(x, True)


@register_fake("quantize_fp8_static")
def _(device, x, scale):
    op = "quantize_fp8_static"
    checks.fp8_input(device, x, op)
    checks.fp8_static_scale(scale, x, op)
    checks.row_view(x, op, "input")
    return _outputs(x, False)


def _rms_norm_fp8(device, x, weight, eps, scale, op: str):
    checks.fp8_input(device, x, op)
    c = checks.NormChecker(op, x, device)
    c.check_input()
    c.weight(weight, fp32_allowed=True)
    checks.check_eps(eps, op)
    if scale is not None:
        checks.fp8_static_scale(scale, x, op)
    return _outputs(x, scale is None)


@register_fake("rms_norm_fp8")
def _(device, x, weight, eps, weight_offset, cast_before_weight):
    return _rms_norm_fp8(device, x, weight, eps, None, "rms_norm_fp8")


@register_fake("rms_norm_fp8_static")
def _(device, x, weight, eps, weight_offset, cast_before_weight, scale):
    return _rms_norm_fp8(device, x, weight, eps, scale, "rms_norm_fp8_static")


def _adaln_fp8(device, x, scale, shift, eps, norm, fp8_scale, op: str):
    checks.fp8_input(device, x, op)
    c = checks.NormChecker(op, x, device)
    c.check_input()
    c.batch_tokens()
    checks.parse_norm(norm, op)
    checks.check_eps(eps, op)
    c.modulation(scale, "scale")
    c.modulation(shift, "shift")
    if fp8_scale is not None:
        checks.fp8_static_scale(fp8_scale, x, op, "fp8_scale")
    return _outputs(x, fp8_scale is None)


@register_fake("adaln_fp8")
def _(device, x, scale, shift, eps, norm):
    return _adaln_fp8(device, x, scale, shift, eps, norm, None, "adaln_fp8")


@register_fake("adaln_fp8_static")
def _(device, x, scale, shift, eps, norm, fp8_scale):
    return _adaln_fp8(device, x, scale, shift, eps, norm, fp8_scale, "adaln_fp8_static")



def _gated_residual_adaln_fp8(device, residual, x, gate, scale, shift, eps, norm, fp8_scale, op: str):
    checks.fp8_input(device, x, op)
    c = checks.NormChecker(op, x, device)
    c.check_input()
    c.batch_tokens()
    c.like_input(residual, "residual", x.dtype)
    c.modulation(gate, "gate")
    checks.parse_norm(norm, op)
    checks.check_eps(eps, op)
    c.modulation(scale, "scale")
    c.modulation(shift, "shift")
    if fp8_scale is not None:
        checks.fp8_static_scale(fp8_scale, x, op, "fp8_scale")
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return (h, *_outputs(x, True)) if fp8_scale is None else (h, _outputs(x, False))


@register_fake("gated_residual_adaln_fp8")
def _(device, residual, x, gate, scale, shift, eps, norm):
    return _gated_residual_adaln_fp8(device, residual, x, gate, scale, shift, eps, norm, None,
                                     "gated_residual_adaln_fp8")


@register_fake("gated_residual_adaln_fp8_static")
def _(device, residual, x, gate, scale, shift, eps, norm, fp8_scale):
    h, q = _gated_residual_adaln_fp8(device, residual, x, gate, scale, shift, eps, norm, fp8_scale,
                                     "gated_residual_adaln_fp8_static")
    return h, q


@register_fake("gelu_fp8")
def _(device, x, approximate):
    checks.gelu_fp8(device, "gelu_fp8", x, None, approximate, None, "input")
    return _outputs(x, True)


@register_fake("gelu_fp8_static")
def _(device, x, approximate, scale):
    checks.gelu_fp8(device, "gelu_fp8_static", x, None, approximate, scale, "input")
    return _outputs(x, False)


@register_fake("gelu_mul_fp8")
def _(device, gate, up, approximate):
    checks.gelu_fp8(device, "gelu_mul_fp8", gate, up, approximate, None, "gate")
    return _outputs(gate, True)


@register_fake("gelu_mul_fp8_static")
def _(device, gate, up, approximate, scale):
    checks.gelu_fp8(device, "gelu_mul_fp8_static", gate, up, approximate, scale, "gate")
    return _outputs(gate, False)


def _half(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@register_fake("geglu_fp8")
def _(device, x, approximate):
    checks.geglu_fp8(device, "geglu_fp8", x, approximate, None)
    return _outputs(_half(x), True)


@register_fake("geglu_fp8_static")
def _(device, x, approximate, scale):
    checks.geglu_fp8(device, "geglu_fp8_static", x, approximate, scale)
    return _outputs(_half(x), False)
