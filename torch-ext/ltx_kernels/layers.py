"""Layers for `kernels.kernelize`: no __init__, only `forward` with the host module's
signature, reading the host module's attributes."""

import torch
from torch import nn

from .activations import gelu
from .norms import rms_norm


class RMSNorm(nn.Module):
    """For transformers' ``"RMSNorm"`` hook (Llama, Mistral, Qwen2/3 ...): the host's
    ``weight * norm(x.float()).to(x.dtype)``, same roundings, and an fp32 output for an
    fp32 weight (type promotion), from its ``weight`` and ``variance_epsilon``."""

    weight: torch.Tensor
    variance_epsilon: float

    has_backward = False
    can_torch_compile = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if hidden_states.dtype == torch.float32 and weight.dtype in (torch.float16, torch.bfloat16):
            weight = weight.float()  # fp32 activations, low-precision weight: the host computes in fp32
        out_dtype = torch.promote_types(weight.dtype, hidden_states.dtype)
        return rms_norm(hidden_states, weight, self.variance_epsilon, cast_before_weight=True,
                        out_dtype=out_dtype)


class RMSNormZeroCentered(nn.Module):
    """For transformers' ``"RMSNormZeroCentered"`` hook (Qwen3.5) and Gemma's RMSNorm
    (mark it with ``kernels.replace_kernel_forward_from_hub``): ``norm(x.float()) *
    (1 + weight.float())`` rounded once to x's dtype, from the host's ``weight`` and
    ``eps``."""

    weight: torch.Tensor
    eps: float

    has_backward = False
    can_torch_compile = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, weight_offset=1.0)


class GeluTanh(nn.Module):
    """For transformers' ``"GeluTanh"`` hook: ``F.gelu(x, approximate="tanh")``."""

    has_backward = False
    can_torch_compile = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return gelu(input, "tanh")
