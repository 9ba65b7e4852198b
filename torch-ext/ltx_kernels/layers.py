"""Layers for `kernels.kernelize`: no __init__, only `forward` with the host module's
signature, reading the host module's attributes."""

import torch
from torch import nn

from .norms import rms_norm


class RMSNorm(nn.Module):
    """For transformers' ``"RMSNorm"`` hook (Llama, Mistral, Qwen2/3 ...).

    Uses the host's ``weight`` and ``variance_epsilon``. The kernel multiplies by the
    weight in fp32 before its one rounding, where the host rounds to the input dtype
    first: results agree within one rounding of the input dtype.
    """

    weight: torch.Tensor
    variance_epsilon: float

    has_backward = False
    can_torch_compile = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)
