"""Independent references, computed in fp64 from the math the host libraries write."""

from typing import Optional

import torch

# Tolerance of one rounding to the output dtype, vs an fp64 reference. rtol is one
# unit in the last place (the kernel rounds once: half an ulp, plus fp32 math).
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2**-10, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
}


def rms_norm_ref(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    return y


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype, f"dtype {actual.dtype}, expected {dtype}"
    assert not actual.isnan().any(), "NaN in output"
    torch.testing.assert_close(actual.double(), expected.double(), **TOLERANCE[dtype])
