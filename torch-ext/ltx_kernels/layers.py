"""Layers for `kernels.kernelize`: no __init__, only `forward` with the host module's
signature, reading the host module's attributes.

Each layer computes what its host computes (same roundings where the host rounds, or one
fp32 rounding where the host rounds intermediates in the model dtype, as each docstring
says). Whatever a layer does not support (a dtype, an affine norm, a custom attention
processor, ...) goes to the host's own forward, ``_host(self).forward``: kernelize binds the
layer's forward to the instance and leaves the class's forward as it was (and
`integration.kernelize_diffusers` then moves it into a subclass, see `_host`). Each layer
tests what its op takes before calling it; the one-op layers also hand a call that an op
still refuses (an argument check, or autograd that the op does not support, such as
forward-mode AD) to the host in eager mode, see `_or_host`.

The transformers layers match the hooks transformers declares (``"RMSNorm"``,
``"RMSNormZeroCentered"``, ``"GeluTanh"``, ``"rotary_pos_emb"``), and under torch.compile
leave their work to inductor (see `_under_torch_compile`); the diffusers layers are for
classes tagged with ``kernels.replace_kernel_forward_from_hub`` (see the README).
"""

import functools
import sys
from types import MethodType
from typing import Optional, Tuple

import torch
from torch import nn

from . import activations, norms, rope
from ._autograd import records_grad
from ._ops import add_op_namespace_prefix
from .activations import geglu, gelu
from .fp8 import adaln_fp8, gated_residual_adaln_fp8, geglu_fp8, gelu_fp8
from .fp8_linear import FP8Linear, FP8Rows
from .norms import adaln, gated_residual, gated_residual_adaln, rms_norm
from .rope import qk_norm_rope, rope_rotate_half

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# qk_norm_rope keeps a row of q in registers on CUDA: at most 32 KiB (16384 bf16 channels).
QK_NORM_ROPE_MAX_ROW_BYTES = 32768


def _on_kernel(*tensors: torch.Tensor) -> bool:
    """Every tensor has a dtype and device the ops take (CPU or CUDA)."""
    # A loop over properties: these checks run on every eager call of a layer, and a
    # generator or a torch.device object per tensor costs host time that decode steps feel.
    for t in tensors:
        if t.dtype not in KERNEL_DTYPES or not (t.is_cuda or t.is_cpu):
            return False
    return True


def _rows(x: torch.Tensor) -> bool:
    """x is what the row ops take without a copy: on a kernel dtype and device, a
    contiguous last dim, leading dims that collapse into one row stride (FLUX hands its
    final norm ``x[:, text_len:]``, which does not)."""
    if not _on_kernel(x) or x.dim() == 0:
        return False
    if x.is_contiguous():
        return True
    if x.stride(-1) != 1 and x.size(-1) != 1:
        return False
    outer = [(size, stride) for size, stride in zip(x.shape[:-1], x.stride()[:-1]) if size != 1]
    return all(stride == inner_size * inner_stride for (_, stride), (inner_size, inner_stride) in zip(outer, outer[1:]))


def _same_device(*tensors: torch.Tensor) -> bool:
    device = tensors[0].device
    return all(t.device == device for t in tensors)


def _vector_of(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """``weight`` is a ``[D]`` row weight for ``x``'s last dim, on x's device."""
    return weight.dim() == 1 and weight.size(0) == x.size(-1) and weight.device == x.device


@functools.lru_cache(maxsize=None)
def _op_names() -> frozenset:
    """The names the ops' argument checks start their messages with ("rms_norm: ..."):
    this build's registered ops and the functional API's public functions."""
    prefix = add_op_namespace_prefix("")
    registered = {name[len(prefix):] for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix)}
    functional = {name for module in (activations, norms, rope) for name, value in vars(module).items()
                  if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__}
    return frozenset(registered | functional)


def _refused_by_an_op(error: Exception) -> bool:
    return str(error).split(":", 1)[0].strip() in _op_names()


def _or_host(forward):
    """A one-op layer's forward that, in eager mode, gives the call to the host's forward
    where an op refuses it (the layer's own tests missed a case the host computes; or
    autograd the ops do not support, such as forward-mode AD): the host then computes it
    as stock does, or raises its own error. Under torch.compile the refusal stands (a fake
    implementation raises at trace time). Only for layers whose kernel path writes nothing
    before its op, so that the host sees the inputs as they were."""

    @functools.wraps(forward)
    def guarded(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return forward(self, *args, **kwargs)
        try:
            return forward(self, *args, **kwargs)
        except (RuntimeError, ValueError, TypeError) as error:  # NotImplementedError is a RuntimeError
            if not _refused_by_an_op(error):
                raise
        return _host(self).forward(_host_self(self), *args, **kwargs)

    return guarded


def _host(module) -> type:
    """The host module's class (the one lookup: `integration` uses it too).
    `integration.kernelize_diffusers` moves each layer's forward from the instance, where
    kernelize binds it, into a subclass of the host's class that names the host in
    ``_ltx_host``: dynamo guards a per-instance forward with the module's hook dicts."""
    return getattr(type(module), "_ltx_host", type(module))


def _under_torch_compile() -> bool:
    """True while torch.compile traces (any backend): the transformers layers then run the
    host's code. Inductor fuses a norm, a rotation or a GELU with the residual add, casts
    and reshapes around it into one kernel, which a custom op splits: a launch-bound decode
    step loses (docs/decisions.md). The diffusers layers fuse more than inductor does (a
    whole LTX block prologue) and stay."""
    return torch.compiler.is_compiling()


# ---------------------------------------------------------------------------------------
# transformers


class RMSNorm(nn.Module):
    """For transformers' ``"RMSNorm"`` hook (Llama, Mistral, Qwen2/3 ...): the host's
    ``weight * norm(x.float()).to(x.dtype)``, same roundings, and an fp32 output for an
    fp32 weight (type promotion), from its ``weight`` and ``variance_epsilon``."""

    weight: torch.Tensor
    variance_epsilon: float

    has_backward = True
    can_torch_compile = True

    @_or_host
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (not _rows(hidden_states) or not isinstance(weight, torch.Tensor) or not _vector_of(weight, hidden_states)
                or weight.dtype not in KERNEL_DTYPES or _under_torch_compile()):
            return _host(self).forward(self, hidden_states)
        out_dtype = torch.promote_types(weight.dtype, hidden_states.dtype)
        if weight.dtype != hidden_states.dtype:
            # fp32 activations with a 16-bit weight, or the other 16-bit dtype: the host's
            # product promotes to fp32, which the weight converted exactly computes alike.
            weight = weight.float()
        return rms_norm(hidden_states, weight, self.variance_epsilon, cast_before_weight=True,
                        out_dtype=out_dtype)


class RMSNormZeroCentered(nn.Module):
    """For transformers' ``"RMSNormZeroCentered"`` hook (Qwen3.5) and Gemma's RMSNorm
    (Gemma, Gemma2, Gemma3; mark it with ``kernels.replace_kernel_forward_from_hub``):
    ``norm(x.float()) * (1 + weight.float())`` rounded once to x's dtype, from the host's
    ``weight`` and ``eps``."""

    weight: torch.Tensor
    eps: float

    has_backward = True
    can_torch_compile = True

    @_or_host
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not _rows(x) or not isinstance(weight, torch.Tensor) or not _vector_of(weight, x) or _under_torch_compile():
            return _host(self).forward(self, x)
        if weight.dtype not in (x.dtype, torch.float32):
            weight = weight.float()  # the host upcasts the weight anyway: exact
        return rms_norm(x, weight, self.eps, weight_offset=1.0)


class GeluTanh(nn.Module):
    """For transformers' ``"GeluTanh"`` hook: ``F.gelu(x, approximate="tanh")``."""

    has_backward = True
    can_torch_compile = True

    @_or_host
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not _rows(input) or _under_torch_compile():
            return _host(self).forward(self, input)
        return gelu(input, "tanh")


class ApplyRotaryPosEmb(nn.Module):
    """For transformers' ``"rotary_pos_emb"`` function hook, ``apply_rotary_pos_emb(q, k,
    cos, sin, unsqueeze_dim=1)`` of Llama, Mistral, Qwen2/3, Gemma and the ~100 model
    files sharing that body: ``x * cos + rotate_half(x) * sin`` on q ``[B, Hq, S, D]`` and
    k ``[B, Hkv, S, D]`` (``[B, S, H, D]`` for ``unsqueeze_dim=2``) with cos/sin
    ``[B, S, D]`` in q's dtype; one rounding where the host rounds each product.

    Tables of another width (gpt-oss passes half-width tables) or another dtype (the host
    would promote), and any other layout, go to the host function. A model file whose
    function has the same signature but other math (nanochat flips the rotation's sign)
    cannot be told apart here: the integration module checks each hooked function
    against this layer before it keeps the replacement."""

    has_backward = True
    can_torch_compile = True

    @_or_host
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        if not _rotate_half_applies(q, k, cos, sin, unsqueeze_dim) or _under_torch_compile():
            return _host(self).forward(_host_self(self), q, k, cos, sin, unsqueeze_dim)
        # unsqueeze_dim is where the heads are: [B, H, S, D] (1) or [B, S, H, D] (2).
        return rope_rotate_half(q, k, cos, sin, sequence_dim=3 - unsqueeze_dim)


def _host_self(wrapper):
    """What to call the host's forward on, for a layer bound to kernels' wrapper module of
    a hooked function. Under torch.compile, kernels (>= 0.18) calls the layer a model
    selected with the function's module-wide wrapper as ``self``, on which the host's
    forward would select the layer again: the host's forward is called on the host class
    instead, an object no model selects a layer for, and runs the function. A host that is
    a module class of its own gets ``wrapper``."""
    host = _host(wrapper)
    if host.__name__ == "Func" and host.__qualname__.endswith("<locals>.Func"):
        return host
    return wrapper


def _rotate_half_applies(q, k, cos, sin, unsqueeze_dim) -> bool:
    """The host's broadcast is the op's: cos/sin ``[B or 1, S, D]`` unsqueezed at the heads
    line up with q and k's (batch, sequence). A 2-D table does not: unsqueezed, the host
    broadcasts it over other dims (the heads, at ``unsqueeze_dim=1``), or fails."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    if unsqueeze_dim not in (1, 2) or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return False
    sequence_dim = 3 - unsqueeze_dim
    return (_on_kernel(q, k, cos, sin) and _same_device(q, k, cos, sin)
            and q.dtype == k.dtype == cos.dtype == sin.dtype
            and q.size(0) == k.size(0)
            and cos.shape == sin.shape and cos.stride() == sin.stride()
            and cos.size(-1) == q.size(-1) == k.size(-1) and q.size(-1) % 2 == 0
            and cos.size(-2) == q.size(sequence_dim) == k.size(sequence_dim)
            and cos.size(0) in (1, q.size(0))
            and q.stride(-1) == k.stride(-1) == cos.stride(-1) == 1)


# ---------------------------------------------------------------------------------------
# diffusers


class DiffusersRMSNorm(nn.Module):
    """For ``diffusers.models.normalization.RMSNorm``: ``x * rsqrt(mean(x**2) + eps)`` in
    fp32, then without a weight rounded to x's dtype; with an fp16/bf16 weight rounded to
    the weight's dtype before the weight multiply; with an fp32 weight multiplied in fp32
    and returned in fp32 (the host's type promotion). A bias, or a low-precision weight of
    another dtype than x, goes to the host."""

    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    eps: float

    has_backward = True
    can_torch_compile = True

    @_or_host
    def forward(self, hidden_states):
        weight = self.weight
        if (self.bias is not None or not _rows(hidden_states)
                or (weight is not None and not _vector_of(weight, hidden_states))):
            return _host(self).forward(self, hidden_states)
        if weight is None:
            return rms_norm(hidden_states, None, self.eps)
        if weight.dtype == torch.float32:
            return rms_norm(hidden_states, weight, self.eps, out_dtype=torch.float32)
        if weight.dtype == hidden_states.dtype:
            return rms_norm(hidden_states, weight, self.eps, cast_before_weight=True)
        return _host(self).forward(self, hidden_states)


def _host_exact_gelu(x: torch.Tensor) -> bool:
    """Whether an exact-GELU layer hands x to the host: fp32 on the CPU, where PyTorch's erf
    GELU is level with the twin's fitted Phi (16 bits: the twin leads; docs/performance.md)."""
    return x.is_cpu and x.dtype == torch.float32


class GEGLU(nn.Module):
    """For ``diffusers.models.activations.GEGLU`` (SD 1.x/2.x/XL UNets, AnimateDiff,
    Hunyuan-DiT): ``value, gate = proj(x).chunk(2, -1)``, ``value * gelu(gate)`` with the
    exact (erf) GELU, in one pass over the projection's output; fp32 on the CPU, the host's."""

    proj: nn.Linear

    has_backward = True
    can_torch_compile = True

    @_or_host
    def forward(self, hidden_states, *args, **kwargs):
        if args or kwargs.get("scale") is not None or _host_exact_gelu(hidden_states):
            # the host warns about `scale`
            return _host(self).forward(self, hidden_states, *args, **kwargs)
        hidden_states = self.proj(hidden_states)
        if not _rows(hidden_states):
            hidden_states, gate = hidden_states.chunk(2, dim=-1)  # the host's expression
            return hidden_states * self.gelu(gate)
        return geglu(hidden_states, "none")


class DiffusersGELU(nn.Module):
    """For ``diffusers.models.activations.GELU``, the feed-forward input of LTX-Video,
    FLUX, SD3 and PixArt: ``F.gelu(proj(x), approximate)``.

    On CUDA with the tanh form, a plain ``nn.Linear`` projection (no subclass, hooks or
    LoRA wrapper: those work through its forward, which this path does not call) with a
    bias, fp16 or bf16, and no grad to record, the GELU runs in the projection GEMM's
    epilogue (cuBLASLt through ``torch._addmm_activation``, which applies the tanh form on
    CUDA and rounds once), eager or compiled (inductor keeps the call): one pass over the
    projection's output fewer (docs/decisions.md). That op has no autograd, and on the CPU
    it applies the erf form. Otherwise:
    ``proj``, then our `gelu` in one pass, or under torch.compile the host's code (inductor
    fuses the bias and the GELU into one kernel itself)."""

    proj: nn.Linear
    approximate: str

    has_backward = True
    can_torch_compile = True

    @_or_host
    def forward(self, hidden_states):
        proj = self.proj
        if (self.approximate == "tanh" and hidden_states.is_cuda and _plain_linear(proj) and proj.bias is not None
                and not records_grad(hidden_states, proj.weight, proj.bias)
                and hidden_states.dtype in (torch.float16, torch.bfloat16)
                and proj.weight.dtype == proj.bias.dtype == hidden_states.dtype
                and proj.weight.device == hidden_states.device):
            flat = hidden_states.reshape(-1, hidden_states.size(-1))
            out = torch._addmm_activation(proj.bias, flat, proj.weight.t(), use_gelu=True)
            return out.view(*hidden_states.shape[:-1], out.size(-1))
        if (self.approximate not in ("none", "tanh") or _under_torch_compile()
                or (self.approximate == "none" and _host_exact_gelu(hidden_states))):
            return _host(self).forward(self, hidden_states)
        hidden_states = proj(hidden_states)
        if not _rows(hidden_states):
            return self.gelu(hidden_states)  # the host's expression
        return gelu(hidden_states, self.approximate)


class FeedForward(nn.Module):
    """For diffusers' ``FeedForward`` (LTX-Video, FLUX, SD3, PixArt) whose two projections
    are `FP8Linear`s (``kernelize_diffusers(fp8=True)``): the input quantized once, the
    GELU written as FP8 for the output projection by `gelu_fp8` / `geglu_fp8`, with no
    16-bit activation between the two GEMMs (see `_fp8_feed_forward`). Any other call
    (extra arguments, an input that requires grad, a feed-forward hooked or changed since)
    runs the host's forward."""

    net: nn.ModuleList

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, *args, **kwargs):
        fp8_ff = None if args or kwargs or records_grad(hidden_states) else _fp8_feed_forward(self, running=True)
        if fp8_ff is None:
            return _host(self).forward(self, hidden_states, *args, **kwargs)
        return fp8_ff(FP8Rows.quantize(hidden_states))


class AdaLayerNormZero(nn.Module):
    """For diffusers' ``AdaLayerNormZero`` (DiT, PixArt, FLUX double blocks, SD3): the
    host's conditioning path (``linear(silu(emb))``, six chunks, shift first), then
    ``norm(x) * (1 + scale_msa) + shift_msa`` in one pass (LayerNorm without affine),
    rounded once where the host rounds the norm, the product and the sum."""

    emb: Optional[nn.Module]
    silu: nn.Module
    linear: nn.Linear
    norm: nn.Module

    has_backward = True
    can_torch_compile = True

    @_or_host
    def forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        if self.emb is not None:
            emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = _modulate(self.norm, x, scale_msa, shift_msa)
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroSingle(nn.Module):
    """For diffusers' ``AdaLayerNormZeroSingle`` (FLUX single blocks): three chunks,
    ``norm(x) * (1 + scale) + shift`` in one pass."""

    silu: nn.Module
    linear: nn.Linear
    norm: nn.Module

    has_backward = True
    can_torch_compile = True

    @_or_host
    def forward(self, x, emb=None):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
        return _modulate(self.norm, x, scale_msa, shift_msa), gate_msa


class AdaLayerNormContinuous(nn.Module):
    """For diffusers' ``AdaLayerNormContinuous`` (SD3, FLUX, and others' final norm):
    ``linear(silu(c).to(x.dtype))`` chunked scale first, then ``norm(x) * (1 + scale) +
    shift`` in one pass. Its norm must have no affine parameters (``elementwise_affine=
    False``, what these models build); an affine norm goes to the host's math."""

    silu: nn.Module
    linear: nn.Linear
    norm: nn.Module

    has_backward = True
    can_torch_compile = True

    @_or_host
    def forward(self, x, conditioning_embedding):
        emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
        scale, shift = torch.chunk(emb, 2, dim=1)
        return _modulate(self.norm, x, scale, shift)


def _adaptive_norm_kind(norm: nn.Module) -> Optional[Tuple[str, float]]:
    """``("layer", eps)`` or ``("rms", eps)`` for a norm module that `adaln` computes (no
    affine parameters, normalising the last dim), else None."""
    if getattr(norm, "weight", None) is not None or getattr(norm, "bias", None) is not None:
        return None
    eps = getattr(norm, "eps", None)
    if not isinstance(eps, float):
        return None
    if isinstance(norm, nn.LayerNorm):  # also diffusers' LayerNorm and FP32LayerNorm
        return ("layer", eps) if len(norm.normalized_shape) == 1 else None
    if type(norm).__name__ == "RMSNorm":  # torch's, or diffusers' (both x * rsqrt(mean(x**2) + eps))
        return "rms", eps
    return None


def _modulate(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The AdaLN modulate of diffusers' norm layers: ``norm(x) * (1 + scale[:, None]) +
    shift[:, None]`` with scale and shift ``[B, D]``, fused when `adaln` computes it, the
    host's expression otherwise."""
    kind = _adaptive_norm_kind(norm)
    if (kind is None or x.dim() != 3 or not _rows(x) or scale.dim() != 2 or shift.dim() != 2
            or scale.dtype != x.dtype or shift.dtype != x.dtype or not _same_device(x, scale, shift)
            or scale.size(-1) != x.size(-1) or shift.size(-1) != x.size(-1)
            # [B', D] broadcast over the tokens: B' must be x's batch or 1, as adaln takes
            or scale.size(0) not in (1, x.size(0)) or shift.size(0) not in (1, x.size(0))):
        return norm(x) * (1 + scale[:, None]) + shift[:, None]
    return adaln(x, scale[:, None], shift[:, None], kind[1], norm=kind[0])


class LTXVideoTransformerBlock(nn.Module):
    """For diffusers' ``LTXVideoTransformerBlock``: the stock block with its norms,
    modulations and residuals (a chain of elementwise ops in the host) in four launches:

    - ``norm1(x) * (1 + scale_msa) + shift_msa``: one `adaln` (RMS);
    - ``x + attn1 * gate_msa``: one `gated_residual`;
    - ``x + attn2`` and ``norm2(x) * (1 + scale_mlp) + shift_mlp``: one
      `gated_residual_adaln` with a unit gate (the sum is rounded as the host rounds it);
    - ``x + ff * gate_mlp``: one `gated_residual`.

    attn1, attn2 (cross-attention, unchanged) and ff are the block's own modules, each
    kernelized or not on its own. The ada values are the host's expression (bit-identical).
    The fused steps compute in fp32 and round once where the host rounds the norm, the
    product and the sum in the model dtype. Affine norms, or ada values of another dtype
    than the hidden states, go to the host's forward.

    With FP8 linears (``kernelize_diffusers(fp8=True)``) the producers write FP8 for them,
    their fp32 values quantized in the same pass, where nothing else reads those
    activations: `adaln_fp8` for attn1's q/k/v projections (when attn1 is this package's
    layer with its stock processor, and nothing hooks it), `gated_residual_adaln_fp8` and
    `gelu_fp8` / `geglu_fp8` for a stock feed-forward's two projections."""

    norm1: nn.Module
    norm2: nn.Module
    attn1: nn.Module
    attn2: nn.Module
    ff: nn.Module
    scale_shift_table: torch.Tensor

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, encoder_attention_mask=None):
        norm1, norm2 = _adaptive_norm_kind(self.norm1), _adaptive_norm_kind(self.norm2)
        if (norm1 is None or norm1[0] != "rms" or norm2 is None or norm2[0] != "rms"
                or self.scale_shift_table.shape[0] != 6 or hidden_states.dim() != 3 or not _rows(hidden_states)
                or torch.promote_types(self.scale_shift_table.dtype, temb.dtype) != hidden_states.dtype):
            return _host(self).forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                       encoder_attention_mask)
        batch_size = hidden_states.size(0)
        ada_values = self.scale_shift_table[None, None].to(temb.device) + temb.reshape(
            batch_size, temb.size(1), 6, -1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada_values.unbind(dim=2)

        if _takes_fp8_rows(self.attn1):
            norm_hidden_states = FP8Rows(*adaln_fp8(hidden_states, scale_msa, shift_msa, norm1[1], norm="rms"),
                                         hidden_states.dtype)
        else:
            norm_hidden_states = adaln(hidden_states, scale_msa, shift_msa, norm1[1], norm="rms")
        attn_hidden_states = self.attn1(
            hidden_states=norm_hidden_states,
            encoder_hidden_states=None,
            image_rotary_emb=image_rotary_emb,
        )
        hidden_states = gated_residual(hidden_states, attn_hidden_states, gate_msa)

        attn_hidden_states = self.attn2(
            hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            image_rotary_emb=None,
            attention_mask=encoder_attention_mask,
        )
        unit_gate = hidden_states.new_ones(hidden_states.size(-1))
        fp8_ff = _fp8_feed_forward(self.ff)
        if fp8_ff is not None:
            hidden_states, q, scales = gated_residual_adaln_fp8(
                hidden_states, attn_hidden_states, unit_gate, scale_mlp, shift_mlp, norm2[1], norm="rms")
            ff_output = fp8_ff(FP8Rows(q, scales, hidden_states.dtype))
        else:
            hidden_states, norm_hidden_states = gated_residual_adaln(
                hidden_states, attn_hidden_states, unit_gate, scale_mlp, shift_mlp, norm2[1], norm="rms")
            ff_output = self.ff(norm_hidden_states)
        return gated_residual(hidden_states, ff_output, gate_mlp)


class LTXAttention(nn.Module):
    """For diffusers' ``LTXAttention`` with its stock ``LTXVideoAttnProcessor``: the
    self-attention prologue ``norm_q(to_q(x))``, ``norm_k(to_k(x))`` (RMSNorm across all
    heads) and the interleaved RoPE in one `qk_norm_rope` launch (same roundings as the
    host); in cross-attention (no RoPE) the two norms as `rms_norm`s (one rounding, as
    torch's fused CUDA RMSNorm rounds). Then the processor's own attention call: the
    ``dispatch_attention_fn`` of the module that defines the processor, with its attention
    backend and parallel config, so attention backends chosen through diffusers still apply.

    After diffusers' ``fuse_qkv_projections()`` (``fused_projections`` set, ``to_qkv``
    built beside the separate projections, which the stock processor keeps using),
    self-attention projects q, k and v in one GEMM without grad, when ``to_q``, ``to_k``,
    ``to_v`` are still plain ``nn.Linear``s (a LoRA wrapper or hook sends it back to the
    three); q and k go to the kernels as strided views of that output. Cross-attention does
    the same with ``to_kv``, which diffusers builds only for an attention marked
    ``is_cross_attention`` (LTX's are not: it builds an unused ``to_qkv`` there). The fused
    weights are copies made at fusing: weights changed in place afterwards need
    ``unfuse_qkv_projections()`` and a new ``fuse_qkv_projections()``, as for diffusers'
    own processors that use them.

    Attention kwargs, other processors, and q/k the kernels do not take (dtypes, norm
    weights of another dtype, rows over 32 KiB for the fused prologue) go to the host's
    path; cross-attention with RoPE uses the host's rotation."""

    heads: int
    to_q: nn.Module
    to_k: nn.Module
    to_v: nn.Module
    norm_q: nn.Module
    norm_k: nn.Module
    to_out: nn.ModuleList
    processor: object

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                **kwargs):
        stock = _stock_ltx_processor_module(self)
        # FP8Rows come from the block, which checked `_takes_fp8_rows` (this path takes them)
        fp8_rows = isinstance(hidden_states, FP8Rows)
        if not fp8_rows and (stock is None or kwargs or hidden_states.dim() != 3):
            return _host(self).forward(self, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                       **kwargs)
        rows = hidden_states.q if fp8_rows else hidden_states
        context = rows if encoder_hidden_states is None else encoder_hidden_states
        batch_size, sequence_length, _ = context.shape
        if attention_mask is not None:
            attention_mask = self.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, self.heads, -1, attention_mask.shape[-1])

        query, key, value = _projections(self, hidden_states, encoder_hidden_states)
        if image_rotary_emb is not None and _qk_norm_rope_applies(self, query, key, *image_rotary_emb):
            cos, sin = image_rotary_emb
            query, key = qk_norm_rope(query, key, self.norm_q.weight, self.norm_k.weight, cos, sin, self.norm_q.eps)
        else:
            query, key = _rms_norm_of(self.norm_q, query), _rms_norm_of(self.norm_k, key)
            if image_rotary_emb is not None:
                query = stock.apply_rotary_emb(query, image_rotary_emb)
                key = stock.apply_rotary_emb(key, image_rotary_emb)

        query = query.unflatten(2, (self.heads, -1))
        key = key.unflatten(2, (self.heads, -1))
        value = value.unflatten(2, (self.heads, -1))

        processor = self.processor
        hidden_states = stock.dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=processor._attention_backend,
            parallel_config=processor._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        hidden_states = self.to_out[0](hidden_states)
        hidden_states = self.to_out[1](hidden_states)
        return hidden_states


class LTXVideoRotaryPosEmbed(nn.Module):
    """For diffusers' ``LTXVideoRotaryPosEmbed``: without ``video_coords`` every batch entry
    has the same position grid, so the host's forward runs for one entry and its fp32
    ``(cos, sin)`` are expanded over the batch (stride 0, the same values bit for bit: the
    host's ops are elementwise). `qk_norm_rope` then reads each table row once for all
    batch entries instead of once per entry: at LTX's batch 2 (classifier-free guidance) a
    quarter of its bytes. ``video_coords`` (per-entry grids) and interpolation scales other
    than numbers and one-element tensors (which could differ per entry) go to the host's
    forward."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, num_frames=None, height=None, width=None, rope_interpolation_scale=None,
                video_coords=None):
        batch_size = hidden_states.size(0)
        if video_coords is not None or batch_size <= 1 or not _one_scale_for_all_entries(rope_interpolation_scale):
            return _host(self).forward(self, hidden_states, num_frames, height, width, rope_interpolation_scale,
                                       video_coords)
        cos, sin = _host(self).forward(self, hidden_states[:1], num_frames, height, width, rope_interpolation_scale)
        return cos.expand(batch_size, -1, -1), sin.expand(batch_size, -1, -1)


def _one_scale_for_all_entries(scales) -> bool:
    """LTX's rope_interpolation_scale is None or three numbers or one-element tensors."""
    return scales is None or all(
        isinstance(scale, (int, float)) or (isinstance(scale, torch.Tensor) and scale.numel() == 1)
        for scale in scales)


def _stock_ltx_processor_module(attn: nn.Module):
    """The module defining attn's processor when that is diffusers' stock
    ``LTXVideoAttnProcessor`` (already imported by the host: nothing is imported here),
    else None."""
    processor_cls = type(getattr(attn, "processor", None))
    if processor_cls.__name__ != "LTXVideoAttnProcessor":
        return None
    module = sys.modules.get(processor_cls.__module__)
    if not (hasattr(module, "dispatch_attention_fn") and hasattr(module, "apply_rotary_emb")):
        return None
    return module


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` itself (no subclass, quantized weight, LoRA wrapper, forward hook
    or patched forward): its output is ``F.linear(x, weight, bias)``, so a path that reads
    its weight without calling it computes the same."""
    return (type(module) is nn.Linear and type(module.weight) is nn.Parameter and not module._forward_hooks
            and not module._forward_pre_hooks and "forward" not in vars(module))


def _layer_forward(module: nn.Module):
    """The function ``module``'s forward runs: its class's, or one kernelize bound to the
    instance; None for another instance forward (a hook library's)."""
    bound = vars(module).get("forward")
    if bound is None:
        return type(module).forward
    return bound.__func__ if isinstance(bound, MethodType) and bound.__self__ is module else None


def _unhooked(*modules: nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _plain_fp8_linear(module) -> bool:
    """An `FP8Linear` running its own forward, unhooked: it reads `FP8Rows` itself."""
    return isinstance(module, FP8Linear) and _layer_forward(module) is FP8Linear.forward and _unhooked(module)


def _takes_fp8_rows(attn: nn.Module) -> bool:
    """attn runs `LTXAttention.forward` with diffusers' stock processor, unhooked (a hook
    would be handed rows it cannot read), and the projections self-attention calls (q, k
    and v, and the fused ``to_qkv`` where `_projections` would take it) are plain
    `FP8Linear`s: self-attention then takes `FP8Rows`."""
    projections = [getattr(attn, "to_q", None), getattr(attn, "to_k", None), getattr(attn, "to_v", None)]
    if getattr(attn, "fused_projections", False) and getattr(attn, "to_qkv", None) is not None:
        projections.append(attn.to_qkv)
    return (_layer_forward(attn) is LTXAttention.forward and _unhooked(attn)
            and _stock_ltx_processor_module(attn) is not None and all(_plain_fp8_linear(p) for p in projections))


def _fp8_feed_forward(ff: nn.Module, running: bool = False):
    """For diffusers' stock ``FeedForward`` in eval mode (``net`` = GELU or GEGLU, dropout,
    linear[, dropout]) whose two projections are plain `FP8Linear`s, its dropouts identities
    and nothing hooked or with another library's forward: a function from the input's
    `FP8Rows` to its output, the activation written as FP8 for the output projection by
    `gelu_fp8` / `geglu_fp8`. Else None. ``running``: ff's own forward asks (its hooks and
    wrappers have run already)."""
    net = getattr(ff, "net", None)
    if (_host(ff).__name__ != "FeedForward" or ff.training
            or not (running or (_layer_forward(ff) in (_host(ff).forward, FeedForward.forward) and _unhooked(ff)))
            or not isinstance(net, nn.ModuleList) or len(net) not in (3, 4)):
        return None
    act, proj_out = net[0], net[2]
    proj_in = getattr(act, "proj", None)
    dropouts = [net[1], *net[3:]]
    kind = _host(act).__name__
    approximate = getattr(act, "approximate", "none") if kind == "GELU" else "none"
    if (kind not in ("GELU", "GEGLU") or approximate not in ("none", "tanh")
            or _layer_forward(act) not in (_host(act).forward, GEGLU.forward, DiffusersGELU.forward)
            or not _unhooked(act) or not _plain_fp8_linear(proj_in) or not _plain_fp8_linear(proj_out)
            or not all(type(d) is nn.Dropout and _layer_forward(d) is nn.Dropout.forward and _unhooked(d)
                       and (not d.training or d.p == 0) for d in dropouts)):
        return None

    def run(rows: FP8Rows) -> torch.Tensor:
        h = proj_in(rows)
        q, scales = geglu_fp8(h, "none") if kind == "GEGLU" else gelu_fp8(h, approximate)
        return proj_out(FP8Rows(q, scales, h.dtype))

    return run


def _projections(attn: nn.Module, hidden_states, encoder_hidden_states: Optional[torch.Tensor]):
    """q, k, v: through diffusers' fused ``to_qkv`` (self-attention) or ``to_kv``
    (cross-attention) when ``fuse_projections`` built them, no grad is recorded and the
    separate projections are plain ``nn.Linear``s (so the fused copy is of what they
    compute); else the three projections. hidden_states may be `FP8Rows` (self-attention
    with FP8 projections)."""
    separate = (attn.to_q, attn.to_k, attn.to_v)
    self_attention = encoder_hidden_states is None
    fused_module = getattr(attn, "to_qkv" if self_attention else "to_kv", None)
    # FP8 linears (kernelize_diffusers(fp8=True)) fuse as their 16-bit originals: rows of a
    # weight are quantized each on its own, so the fused copy computes the same.
    fp8 = isinstance(attn.to_q, FP8Linear)
    fused = (fused_module is not None and getattr(attn, "fused_projections", False)
             and all(isinstance(p, FP8Linear) if fp8 else _plain_linear(p) for p in separate)
             and isinstance(fused_module, FP8Linear) == fp8
             and not records_grad(hidden_states.q if isinstance(hidden_states, FP8Rows) else hidden_states,
                                  encoder_hidden_states,
                                  *(p.weight for p in separate if not isinstance(p, FP8Linear))))
    if self_attention:
        if fused:
            sizes = [attn.to_q.out_features, attn.to_k.out_features, attn.to_v.out_features]
            return fused_module(hidden_states).split(sizes, dim=-1)
        return attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    query = attn.to_q(hidden_states)
    if fused:
        key, value = fused_module(encoder_hidden_states).split([attn.to_k.out_features, attn.to_v.out_features], dim=-1)
        return query, key, value
    if (fp8 and _plain_fp8_linear(attn.to_k) and _plain_fp8_linear(attn.to_v)
            and not records_grad(encoder_hidden_states)):
        # k and v project the same context: one quantize pass for both
        context = FP8Rows.quantize(encoder_hidden_states)
        return query, attn.to_k(context), attn.to_v(context)
    return query, attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)


def _weighted_rms_norm(norm: nn.Module, x: torch.Tensor) -> bool:
    """norm is a ``torch.nn.RMSNorm`` over x's last dim with a weight of x's dtype and a
    float eps: what `rms_norm` and `qk_norm_rope` compute with one rounding."""
    return (isinstance(norm, nn.RMSNorm) and norm.weight is not None and isinstance(norm.eps, float)
            and norm.weight.dtype == x.dtype and norm.normalized_shape == (x.size(-1),))


def _rms_norm_of(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` as one `rms_norm` where it applies; the host's module call otherwise."""
    if _weighted_rms_norm(norm, x) and _rows(x):
        return rms_norm(x, norm.weight, norm.eps)
    return norm(x)


def _qk_norm_rope_applies(attn: nn.Module, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> bool:
    norm_q, norm_k = attn.norm_q, attn.norm_k
    return (_weighted_rms_norm(norm_q, query) and _weighted_rms_norm(norm_k, key) and norm_q.eps == norm_k.eps
            and query.shape == key.shape and query.dtype == key.dtype and _on_kernel(query)
            and query.size(-1) * query.element_size() <= QK_NORM_ROPE_MAX_ROW_BYTES
            and cos.shape == sin.shape and cos.dim() in (2, 3) and cos.shape[-2:] == query.shape[-2:]
            and cos.dtype in (torch.float32, query.dtype))
