"""ltx-kernels: fast kernels for the memory-bound layers of diffusion transformers and LLMs."""

from . import layers
from ._ops import ops
from .norms import rms_norm

__all__ = ["layers", "ops", "rms_norm"]
