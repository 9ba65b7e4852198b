"""Independent references, computed in fp64 from the math the host libraries write."""

import math
from typing import Optional

import torch

# Tolerance of one rounding to the output dtype, vs an fp64 reference. rtol is one
# unit in the last place (the kernel rounds once: half an ulp, plus fp32 math).
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2**-10, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
    torch.float64: dict(rtol=1e-12, atol=1e-12),  # the CPU backend only
}


def rms_norm_ref(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
) -> torch.Tensor:
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        y = y.to(x.dtype).double()
    if weight is not None:
        y = y * (weight_offset + weight.double())
    return y


def layer_norm_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    mean = x64.mean(-1, keepdim=True)
    return (x64 - mean) * torch.rsqrt((x64 - mean).pow(2).mean(-1, keepdim=True) + eps)


def adaln_ref(x, scale, shift, eps, norm):
    """``norm(x) * (1 + scale) + shift``; scale/shift [D], [B, D] or [B, S, D]."""
    n = rms_norm_ref(x, None, eps) if norm == "rms" else layer_norm_ref(x, eps)
    if x.dim() == 3 and scale.dim() == 2:
        scale, shift = scale[:, None], shift[:, None]
    return n * (1 + scale.double()) + shift.double()


def adaln_checking_stats(kernel, x, scale, shift, eps, norm, residual=None, gate=None):
    """AdaLN (after the gated residual where a residual is given) through the op that saves
    each row's (mean, rstd): its outputs must be the bits of the op without statistics, and
    the statistics those of the normalised rows in fp64. Returns (normed rows, statistics)."""
    if residual is None:
        out, stats = kernel.ops.adaln_with_stats(x, scale, shift, eps, norm)
        assert torch.equal(out, kernel.ops.adaln(x, scale, shift, eps, norm))
        normed = x
    else:
        normed, out, stats = kernel.ops.gated_residual_adaln_with_stats(residual, x, gate, scale, shift, eps, norm)
        without = kernel.ops.gated_residual_adaln(residual, x, gate, scale, shift, eps, norm)
        assert torch.equal(normed, without[0]) and torch.equal(out, without[1])
    n64 = normed.double()
    mean = n64.mean(-1) if norm == "layer" else torch.zeros_like(n64[..., 0])
    rstd = (n64 - mean[..., None]).square().mean(-1).add(eps).rsqrt()
    torch.testing.assert_close(stats.double(), torch.stack([mean, rstd], -1), rtol=1e-5, atol=1e-5)
    return normed, stats


def gated_residual_ref(residual, x, gate):
    """``residual + x * gate`` rounded once to the input dtype."""
    if x.dim() == 3 and gate.dim() == 2:
        gate = gate[:, None]
    return (residual.double() + x.double() * gate.double()).to(x.dtype)


def rope_ref(x, cos, sin, interleaved):
    """x [B, H, S, D]; cos/sin [S, R] or [B, S, R]; channels past R pass through."""
    r = cos.shape[-1]
    c, s = cos.double(), sin.double()
    if c.dim() == 3:
        c, s = c[:, None], s[:, None]
    x64 = x.double()
    rot = x64[..., :r]
    if interleaved:
        real, imag = rot.unflatten(-1, (-1, 2)).unbind(-1)
        turned = torch.stack([-imag, real], -1).flatten(-2)
    else:
        turned = torch.cat([-rot[..., r // 2:], rot[..., :r // 2]], -1)
    return torch.cat([rot * c + turned * s, x64[..., r:]], -1)


def rounded_norm_atol(normed, dtype):
    """qk_norm_rope's atol: the normed value is rounded before the rotation (as the host
    does); where the two rotation terms cancel, ties of a pair rounded the other way show as
    an absolute error of up to (|cos| + |sin|) ulp of |normed| <= 2 ulp of the largest (at
    least of 4)."""
    top = max(4.0, normed.abs().max().item())
    return 2 * TOLERANCE[dtype]["rtol"] * 2.0 ** math.floor(math.log2(top))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, roundings: int = 1,
                 atol: float = 1e-5) -> None:
    """Within `roundings` units in the last place of `dtype` of an fp64 reference."""
    assert actual.dtype == dtype, f"dtype {actual.dtype}, expected {dtype}"
    assert not actual.isnan().any(), "NaN in output"
    rtol = TOLERANCE[dtype]["rtol"] * roundings
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)
