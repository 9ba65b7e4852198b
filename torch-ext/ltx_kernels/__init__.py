"""ltx-kernels: fast kernels for the memory-bound layers of diffusion transformers and LLMs."""

from . import layers, reference, sharding
from ._ops import ops
from .activations import geglu, gelu, gelu_mul
from .fp8 import adaln_fp8, gated_residual_adaln_fp8, geglu_fp8, gelu_fp8, gelu_mul_fp8, quantize_fp8, rms_norm_fp8
from .fp8_linear import FP8Linear, FP8Rows, convert_linears_to_fp8, restore_linears
from .integration import diffusers_mapping, kernelize_diffusers, kernelize_transformers, replaced_modules, \
    transformers_mapping, unkernelize
from .norms import adaln, fused_add_rms_norm, gated_residual, gated_residual_adaln, rms_norm
from .rope import qk_norm_rope, rope_interleaved, rope_rotate_half

sharding.register_when_available()  # DTensor rules for this build's op namespace

__all__ = [
    "adaln",
    "adaln_fp8",
    "convert_linears_to_fp8",
    "diffusers_mapping",
    "FP8Linear",
    "FP8Rows",
    "fused_add_rms_norm",
    "gated_residual",
    "gated_residual_adaln",
    "gated_residual_adaln_fp8",
    "geglu",
    "geglu_fp8",
    "gelu",
    "gelu_fp8",
    "gelu_mul",
    "gelu_mul_fp8",
    "kernelize_diffusers",
    "kernelize_transformers",
    "layers",
    "ops",
    "qk_norm_rope",
    "quantize_fp8",
    "reference",
    "replaced_modules",
    "restore_linears",
    "rms_norm",
    "rms_norm_fp8",
    "rope_interleaved",
    "rope_rotate_half",
    "transformers_mapping",
    "unkernelize",
]
