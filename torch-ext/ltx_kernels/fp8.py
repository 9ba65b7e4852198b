"""FP8 producers for ``torch._scaled_mm`` with row-wise scales: ops that compute a row's fp32
result and write it as ``float8_e4m3fn`` with its fp32 scale, in one op, with their fake
(meta) implementations for torch.compile beside them.

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

