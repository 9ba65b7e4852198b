"""Linear layers as FP8 GEMMs, for inference: `FP8Linear` (one ``nn.Linear``) and
`convert_linears_to_fp8` / `restore_linears` (a model's transformer blocks).

The weight is quantized once, per output channel (its rows, by `quantize_fp8`); each call
quantizes its input per row (per token) with `quantize_fp8`, one pass over the activations,
or takes `FP8Rows` a producer already wrote (a norm or GELU op's ``*_fp8`` form, no pass of
its own), and runs ``torch._scaled_mm`` with both row-wise scales and the bias, in the
input's dtype.
Accumulation is fp32 with ``fast_accum=False`` (Hopper's FP8 tensor cores still add in
fewer bits between its fp32 promotions); ``fast_accum=True`` skips those promotions for
speed. On CUDA it needs a GPU of compute capability 8.9 or newer and bfloat16 inputs (the
row-wise scaled GEMM's output type); on the CPU any 16- or 32-bit float input (a reference
path: the fp32 GEMM of the FP8 operands, then the scales, not a fast one).
"""

from typing import List, NamedTuple, Optional, Tuple, Union

import torch

from .fp8 import quantize_fp8

__all__ = ["FP8Linear", "FP8Rows", "convert_linears_to_fp8", "restore_linears"]

# _scaled_mm takes both GEMM dims in multiples of 16.
_GEMM_MULTIPLE = 16
# Module names, within a transformer block, whose linears become FP8: attention and
# feed-forward (diffusers' LTX-Video, FLUX, SD3, DiT blocks); FLUX's single blocks name
# their MLP projections directly. AdaLN's small modulation GEMMs stay 16-bit.
_FP8_PARENTS = ("attn", "attn1", "attn2", "ff", "ff_context")
_FP8_NAMES = ("proj_mlp", "proj_out")
_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")


class FP8Rows(NamedTuple):
    """Activations a producer wrote as FP8 (`adaln_fp8`, `gated_residual_adaln_fp8`,
    `gelu_fp8`, ...), as an `FP8Linear` input: ``q`` [..., in] float8_e4m3fn, contiguous,
    ``scales`` its rows' fp32 scales [..., 1], and ``dtype`` the 16-bit dtype of the
    activations they stand for (the GEMM's output dtype)."""

    q: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @staticmethod
    def quantize(x: torch.Tensor) -> "FP8Rows":
        """``x`` [..., D] by `quantize_fp8`: rows that nn.Linear takes as views (transposed,
        expanded) copied contiguous first."""
        q, scales = _quantize_rows(x)
        return FP8Rows(q.reshape(x.shape), scales.reshape(*x.shape[:-1], 1), x.dtype)


def _quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] as 2-D FP8 rows [M, D] and their scales [M, 1] (`quantize_fp8`), the
    rows copied contiguous first where nn.Linear hands over a view (transposed, expanded)."""
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    return quantize_fp8(rows)


class FP8Linear(torch.nn.Module):
    """``linear`` as an FP8 GEMM (see the module's doc). A copy of ``linear`` is kept on the
    CPU (the 16-bit weight need not stay on the GPU) and not as a submodule (no state-dict
    entries, no ``.to()``), so that `restore_linears` can put it back on the layer's device.
    A dtype cast of the model (``.to(torch.bfloat16)``, ``.half()``) leaves the FP8 weight
    and its fp32 scales as they are."""

    def __init__(self, linear: torch.nn.Linear, *, fast_accum: bool = False):
        super().__init__()
        reason = fp8_refusal(linear)
        if reason:
            raise ValueError(f"FP8Linear: {reason}")
        weight = linear.weight.detach()
        q, scales = quantize_fp8(weight)
        self.register_buffer("weight_fp8", q)
        self.register_buffer("weight_scale", scales.reshape(1, -1))  # [1, out]: scale_b
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fast_accum = fast_accum
        self._original: Tuple[torch.nn.Linear] = (_cpu_copy(linear),)

    def _apply(self, fn, recurse=True):
        # float8 counts as a floating type: a model-wide dtype cast would convert the FP8
        # weight and its scales; they keep their dtypes and take the new device only.
        weight, scale = self.weight_fp8, self.weight_scale
        super()._apply(fn, recurse)
        if self.weight_fp8.dtype != weight.dtype:
            self.weight_fp8 = weight.to(self.weight_fp8.device)
        if self.weight_scale.dtype != scale.dtype:
            self.weight_scale = scale.to(self.weight_scale.device)
        return self

    def forward(self, x: Union[torch.Tensor, FP8Rows]) -> torch.Tensor:
        if isinstance(x, FP8Rows):
            return self._gemm(x.q, x.scales, x.dtype)
        if x.requires_grad:
            raise RuntimeError("FP8Linear is for inference: its input requires grad (FP8 GEMMs have no "
                               "backward here; run under torch.no_grad() or torch.inference_mode())")
        self._check(x.shape[-1], x.device, x.dtype)  # before the quantize pass
        # The 2-D rows straight to the GEMM, not through FP8Rows: each reshape there and back
        # is a dispatcher call of host time in an eager forward.
        q, scales = _quantize_rows(x)
        return self._rows_gemm(q, scales, x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _check(self, features: int, device: torch.device, dtype: torch.dtype) -> None:
        if features != self.in_features:
            raise ValueError(f"FP8Linear: input of {features} features, the layer takes {self.in_features}")
        if device.type == "cuda" and dtype != torch.bfloat16:
            raise TypeError(f"FP8Linear on CUDA takes bfloat16 input (the row-wise scaled GEMM's output), "
                            f"got {dtype}")

    def _gemm(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """q [..., in] times the weight, scaled, plus the bias, in ``dtype``: [..., out]."""
        self._check(q.shape[-1], q.device, dtype)
        if q.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32 or scales.shape != (*q.shape[:-1], 1):
            raise TypeError(f"FP8Linear: FP8Rows take float8_e4m3fn q [..., {self.in_features}] and float32 scales "
                            f"[..., 1], got {q.dtype} {tuple(q.shape)} and {scales.dtype} {tuple(scales.shape)}")
        y = self._rows_gemm(q.reshape(-1, self.in_features), scales.reshape(-1, 1), dtype)
        return y.reshape(*q.shape[:-1], self.out_features)

    def _rows_gemm(self, rows: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """FP8 rows [M, in] with their scales [M, 1] times the weight, plus the bias: [M, out]."""
        bias = self.bias
        if bias is not None and bias.dtype != dtype:
            bias = bias.to(dtype)
        if rows.device.type == "cpu":
            # The scaled GEMM in fp32, as torch's CPU emulation computes it: the CPU
            # torch._scaled_mm of some releases (2.11's oneDNN path) refuses row-wise scales.
            y = (rows.float() @ self.weight_fp8.float().t()) * row_scales * self.weight_scale
            return (y if bias is None else y + bias.float()).to(dtype)
        return torch._scaled_mm(rows, self.weight_fp8.t(), scale_a=row_scales, scale_b=self.weight_scale,
                                bias=bias, out_dtype=dtype, use_fast_accum=self.fast_accum)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fast_accum={self.fast_accum}")


def _cpu_copy(linear: torch.nn.Linear) -> torch.nn.Linear:
    """``linear`` copied to the CPU without a second copy on its own device."""
    copied = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    for name in ("weight", "bias"):
        p = getattr(linear, name)
        if p is not None:
            setattr(copied, name, torch.nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=p.requires_grad))
    return copied.train(linear.training)


def _lora_wrapped(module: torch.nn.Module) -> bool:
    """peft's LoRA layers (a base_layer inside), diffusers' LoRA-compatible linears with an
    adapter attached."""
    return getattr(module, "base_layer", None) is not None or getattr(module, "lora_layer", None) is not None \
        or "lora" in type(module).__name__.lower()


def fp8_refusal(module: torch.nn.Module) -> Optional[str]:
    """Why ``module`` cannot become an `FP8Linear`, or None."""
    if _lora_wrapped(module):
        return (f"{type(module).__name__} is LoRA-wrapped: merge the adapters first (peft's merge_and_unload, "
                "diffusers' fuse_lora + unload_lora_weights), then convert")
    if type(module) is not torch.nn.Linear or type(module.weight) is not torch.nn.Parameter:
        return f"{type(module).__name__} is not a plain torch.nn.Linear (a subclass, or a quantized weight)"
    if module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module):
        return "it has forward hooks or an instance forward (another library's), which the FP8 layer would drop"
    if module.in_features % _GEMM_MULTIPLE or module.out_features % _GEMM_MULTIPLE:
        return (f"[{module.out_features}, {module.in_features}] weight: the FP8 GEMM takes sizes in "
                f"multiples of {_GEMM_MULTIPLE}")
    return None


def fp8_device_refusal(device: torch.device) -> Optional[str]:
    """Why FP8 GEMMs cannot run on ``device``, or None."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return f"FP8 needs a GPU of compute capability 8.9 or newer (found {major}.{minor})"
    elif device.type != "cpu":
        return f"FP8 linears run on CUDA or the CPU, not {device.type}"
    return None


Plan = List[Tuple[torch.nn.Module, str, torch.nn.Linear]]


def fp8_plan(model: torch.nn.Module) -> Plan:
    """(parent, attribute, linear) of each attention / feed-forward linear of ``model``'s
    transformer blocks that can become an `FP8Linear` (others, of sizes the GEMM cannot take,
    stay 16-bit), after refusing a model in training mode, LoRA-wrapped linears, a device
    without FP8 and, on CUDA, a model not in bfloat16. Changes nothing."""
    if model.training:
        raise RuntimeError("fp8: the model is in training mode; FP8 linears are for inference (call model.eval())")
    plan: Plan = []
    for list_name in _BLOCK_LISTS:
        for block in getattr(model, list_name, None) or ():
            for path, module in block.named_modules():
                parts = path.split(".")
                in_scope = any(p in _FP8_PARENTS for p in parts[:-1]) or (len(parts) == 1 and parts[0] in _FP8_NAMES)
                if not in_scope:
                    continue
                if _lora_wrapped(module):
                    raise ValueError(f"fp8: {block.__class__.__name__}.{path}: {fp8_refusal(module)}")
                if fp8_refusal(module) is None:
                    parent = block.get_submodule(".".join(parts[:-1])) if len(parts) > 1 else block
                    plan.append((parent, parts[-1], module))
    for device in {linear.weight.device for _, _, linear in plan}:
        reason = fp8_device_refusal(device)
        if reason:
            raise RuntimeError(f"fp8: {reason}")
    if any(linear.weight.device.type == "cuda" and linear.weight.dtype != torch.bfloat16 for _, _, linear in plan):
        raise TypeError("fp8: on CUDA the model must be bfloat16 (the row-wise scaled GEMM's output type)")
    return plan


def apply_fp8_plan(plan: Plan, *, fast_accum: bool = False) -> int:
    for parent, name, linear in plan:
        setattr(parent, name, FP8Linear(linear, fast_accum=fast_accum))
    return len(plan)


def undo_fp8_plan(plan: Plan) -> None:
    """The plan's linears back in their places (those apply_fp8_plan converted, or all)."""
    for parent, name, linear in plan:
        setattr(parent, name, linear)


def convert_linears_to_fp8(model: torch.nn.Module, *, fast_accum: bool = False) -> int:
    """The attention and feed-forward linears of ``model``'s transformer blocks as
    `FP8Linear` (see `fp8_plan` for what is refused); returns how many."""
    plan = fp8_plan(model)
    if not plan:
        raise ValueError(f"fp8: {type(model).__name__} has no attention or feed-forward linear in "
                         f"{' or '.join(_BLOCK_LISTS)} to convert")
    return apply_fp8_plan(plan, fast_accum=fast_accum)


def restore_linears(model: torch.nn.Module) -> int:
    """Every `FP8Linear` in ``model`` back to the ``nn.Linear`` it was made from; returns how many."""
    found = [(path, m) for path, m in model.named_modules() if isinstance(m, FP8Linear)]
    for path, module in found:
        parent_path, _, name = path.rpartition(".")
        original = module._original[0].to(module.weight_fp8.device)
        setattr(model.get_submodule(parent_path) if parent_path else model, name, original)
    return len(found)
