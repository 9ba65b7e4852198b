"""The C++ entry points' argument checks, in Python, for the fake (meta) implementations:
the same checks in the same order with the same messages as kernel_src/common.h, norm.h,
rope.h, activation.h, fp8.h and torch-ext/torch_binding.cpp, so that a bad call fails at trace
time under torch.compile, under FakeTensorMode and on meta tensors as it fails eagerly.

Sizes may be SymInts: they are compared (a comparison guards, as the real op's check
would fail for other values), never converted to int. tests/test_fake_checks.py compares
every refusal of the bad-input table with the compiled op's message: a check changed in
C++ must change here too.
"""

import functools
from typing import Callable, Optional, Sequence

import torch

from ._ops import add_op_namespace_prefix

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
HALF_TYPES = (torch.float16, torch.bfloat16)
FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
# The widest row CUDA's qk_norm_rope keeps in registers: 512 threads x 4 vectors of 16 bytes.
QK_NORM_ROPE_CUDA_MAX_ROW_BYTES = 512 * 4 * 16

# c10's spelling of dtypes and device types, as the C++ messages print them.
_SCALAR_TYPE_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool", torch.complex32: "ComplexHalf", torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}
_DEVICE_TYPE_NAMES = {"privateuseone": "PrivateUse1"}
# Device type -> its dispatch key, in the dispatcher's order of backends, lowest priority
# first: a call's kernel is that of its tensors' highest (meta, above all, is handled apart).
_BACKEND_KEYS = {"cpu": "CPU", "cuda": "CUDA", "hip": "HIP", "xla": "XLA", "mps": "MPS", "ipu": "IPU", "xpu": "XPU",
                 "hpu": "HPU", "ve": "VE", "lazy": "Lazy", "mtia": "MTIA", "maia": "MAIA",
                 "privateuseone": "PrivateUse1"}
_BACKEND_ORDER = list(_BACKEND_KEYS)


def scalar_type_name(dtype: torch.dtype) -> str:
    name = _SCALAR_TYPE_NAMES.get(dtype)
    if name is not None:
        return name
    short = str(dtype).removeprefix("torch.")  # float8_e4m3fn -> Float8_e4m3fn, uint16 -> UInt16, ...
    for prefix, c10 in (("quint", "QUInt"), ("qint", "QInt"), ("uint", "UInt")):
        if short.startswith(prefix):
            return c10 + short[len(prefix):]
    return short[:1].upper() + short[1:]


def device_type_name(device_type: str) -> str:
    return _DEVICE_TYPE_NAMES.get(device_type, device_type.upper())


def sizes(shape: Sequence) -> str:
    """at::IntArrayRef as C++ prints it: [2, 3, 64] (SymInts by their names)."""
    return "[" + ", ".join(str(s) for s in shape) + "]"


def number(x) -> str:
    """A double as C++ streams it (six significant digits)."""
    return f"{x:g}" if isinstance(x, (int, float)) else str(x)


def check(cond, message: Callable[[], str]) -> None:
    """TORCH_CHECK: a RuntimeError with message() unless cond (a bool, or a SymBool, which guards)."""
    torch._check(cond, message)


# Conditions on sizes are built without bool(), which on a SymInt guards and on a
# data-dependent size (after a boolean mask, say) fails the trace: torch._check then
# guards, or defers the check to run time.


def all_of(*conds):
    if all(isinstance(c, bool) for c in conds):
        return all(conds)
    from torch.fx.experimental.symbolic_shapes import sym_and

    return sym_and(*conds)


def any_of(*conds):
    if all(isinstance(c, bool) for c in conds):
        return any(conds)
    from torch.fx.experimental.symbolic_shapes import sym_or

    return sym_or(*conds)


def sym_not(cond):
    return (not cond) if isinstance(cond, bool) else torch.sym_not(cond)


def surely(cond) -> bool:
    """cond as a bool, False where the sizes cannot tell (a data-dependent size)."""
    if isinstance(cond, bool):
        return cond
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return guard_or_false(cond)


def same_sizes(a: Sequence, b: Sequence):
    return len(a) == len(b) and all_of(True, *(x == y for x, y in zip(a, b)))


# ---------------------------------------------------------------------------- devices


def kernel_device(qualname: str, tensors: Sequence[torch.Tensor]) -> Optional[str]:
    """The device type whose kernel a call on these tensors reaches (the dispatcher picks
    the highest-priority backend among them: a CPU tensor beside a CUDA one reaches the
    CUDA kernel, which refuses it), or None when a tensor is on the meta device: the call
    then reaches this fake itself, and the same-device checks refuse any mix."""
    types = {t.device.type for t in tensors}
    if not types or "meta" in types:
        return None
    device = max(types, key=lambda d: _BACKEND_ORDER.index(d) if d in _BACKEND_KEYS else len(_BACKEND_ORDER))
    key = _BACKEND_KEYS.get(device, device_type_name(device))
    try:
        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)
    except RuntimeError:  # a device type without a dispatch key of that name
        has_kernel = False
    if not has_kernel:
        raise NotImplementedError(f"Could not run '{qualname}' with arguments from the '{key}' backend: "
                                  f"this build has no {key} kernels")
    return device


def register_fake(name: str):
    """Registers the decorated function as op `name`'s fake (and meta) implementation. It
    is called as fn(device, *args): `device` as kernel_device gives it."""
    qualname = add_op_namespace_prefix(name)

    def register(fake):
        def checked(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            return fake(kernel_device(qualname, tensors), *args, **kwargs)

        torch.library.register_fake(qualname)(checked)
        return fake

    return register


def check_device(t: torch.Tensor, device: Optional[str], op: str, arg: str) -> None:
    check(device is None or t.device.type == device,
          lambda: f"{op}: {arg} is on {t.device} but this implementation runs on {device_type_name(device)} tensors")


def check_same_device(a: torch.Tensor, b: torch.Tensor, op: str, arg_a: str, arg_b: str) -> None:
    check(a.device == b.device, lambda: f"{op}: {arg_a} is on {a.device} but {arg_b} is on {b.device}")


def takes_float64(t: torch.Tensor) -> bool:
    """float64 is for the CPU kernels (meta tensors may stand for CPU ones)."""
    return t.device.type in ("cpu", "meta")


def check_float_dtype(t: torch.Tensor, op: str, arg: str) -> None:
    cpu = takes_float64(t)
    check(t.dtype in FLOAT_TYPES or (cpu and t.dtype == torch.float64),
          lambda: f"{op}: {arg} has dtype {scalar_type_name(t.dtype)}; expected float32, float16 or bfloat16"
          + (" (or float64 on the CPU)" if cpu else ""))


# ---------------------------------------------------------------------------- layouts and memory


def row_view(t: torch.Tensor, op: str, arg: str):
    """row_view in common.h: t as (rows, cols, row_stride), leading dims of one stride."""
    check(t.dim() >= 1, lambda: f"{op}: {arg} must have at least 1 dim, got a 0-dim tensor")
    shape, strides = t.shape, t.stride()
    cols = shape[-1]
    check(any_of(strides[-1] == 1, cols <= 1), lambda: f"{op}: {arg} must be contiguous in its last dim, got "
          f"stride {strides[-1]} (call .contiguous() first)")
    if surely(t.numel() == 0):
        return 0, cols, cols
    rows, row_stride, expected = 1, cols, None
    for d in range(t.dim() - 2, -1, -1):  # innermost first; size-1 dims carry no stride
        rows = rows * shape[d]
        if surely(shape[d] == 1):
            continue
        if expected is None:
            row_stride = strides[d]
            expected = row_stride * shape[d]
            continue
        check(strides[d] == expected, lambda: f"{op}: {arg} with sizes {sizes(shape)} and strides {sizes(strides)} "
              "has leading dims that do not collapse into rows of one stride (call .contiguous() first)")
        expected = expected * shape[d]
    check(any_of(row_stride >= cols, rows <= 1),
          lambda: f"{op}: {arg} has overlapping rows (row stride {row_stride} < last dim {cols})")
    return rows, cols, row_stride


def _dense(t: torch.Tensor) -> bool:
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return is_non_overlapping_and_dense_or_false(t)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):  # a tensor without storage (a functional wrapper) shares none
        return False


def _decided(decide: Callable, otherwise):
    """decide(), or `otherwise` where a data-dependent size leaves it open (the real op's
    check then runs when the compiled code runs)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        return decide()
    except GuardOnDataDependentSymNode:
        return otherwise


# Memory shared between tensors, by byte ranges (common.h's overlap_detail). Addresses are
# byte offsets into the one storage: only views of one storage can share memory, and the
# tests below depend on the difference of two addresses alone.


def _strided_dims(t: torch.Tensor):
    """(byte stride, size) of each dim of more than one element."""
    item = t.element_size()
    return [(stride * item, size) for size, stride in zip(t.shape, t.stride()) if size > 1]


def _byte_range(t: torch.Tensor):
    begin = t.storage_offset() * t.element_size()
    end = begin + t.element_size()
    for stride, size in _strided_dims(t):
        end = end + stride * (size - 1)
    return begin, end


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.storage_offset() * a.element_size() == b.storage_offset() * b.element_size()
            and a.element_size() == b.element_size() and same_sizes(a.shape, b.shape)
            and _strided_dims(a) == _strided_dims(b))


def _extent_within(t: torch.Tensor, period) -> int:
    """The bytes t spans modulo `period` when its dims of strides that are not multiples
    of the period span less than one period; else -1."""
    extent = t.element_size()
    for stride, size in _strided_dims(t):
        if stride % period != 0:
            extent = extent + stride * (size - 1)
    return extent if extent <= period else -1


def _interleaved_apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b provably share no byte: for one of their strides as the period, each lies in
    an interval (mod the period) and the two intervals are apart."""
    a_dims, b_dims = _strided_dims(a), _strided_dims(b)
    a_start, b_start = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    for period, _ in (*a_dims, *b_dims):
        if period <= 0:
            continue
        extent_a, extent_b = _extent_within(a, period), _extent_within(b, period)
        if extent_a < 0 or extent_b < 0:
            continue
        b_after_a = (b_start - a_start) % period  # where b starts, seen from a's start
        if b_after_a >= extent_a and period - b_after_a >= extent_b:
            return True
    return False


NONE, SAME_VIEW, PARTIAL = "none", "same view", "partial"


def memory_sharing(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> str:
    """NONE: no byte in common; SAME_VIEW: the same elements exactly; PARTIAL: anything else.
    What data-dependent sizes leave open counts as NONE."""
    if a is None or b is None or a.device != b.device or not _same_storage(a, b):
        return NONE

    def sharing() -> str:
        if a.numel() == 0 or b.numel() == 0:
            return NONE
        (a_begin, a_end), (b_begin, b_end) = _byte_range(a), _byte_range(b)
        if a_end <= b_begin or b_end <= a_begin:
            return NONE
        if _same_view(a, b):
            return SAME_VIEW
        return NONE if _interleaved_apart(a, b) else PARTIAL

    return _decided(sharing, otherwise=NONE)


def elements_apart(t: torch.Tensor) -> bool:
    """Each element has bytes of its own: with t's dims sorted by stride, each stride clears
    the span of the dims inside it."""
    if _dense(t):
        return True  # (what the walk below finds, without guards on symbolic strides)

    def walk() -> bool:
        span = t.element_size()
        for stride, size in sorted(_strided_dims(t)):
            if stride < span:
                return False
            span = stride * (size - 1) + span
        return True

    return _decided(walk, otherwise=True)


def check_output_overlap(out: torch.Tensor, inputs: Sequence, op: str, arg: str) -> None:
    """An output writes no element twice and shares no memory with an input but for being
    that input itself. inputs: (tensor or None, name) pairs."""
    check(_decided(lambda: bool(out.numel() == 0), otherwise=False) or elements_apart(out),
          lambda: f"{op}: {arg} has elements that share memory (an expanded view?): sizes {sizes(out.shape)} and "
          f"strides {sizes(out.stride())}; pass a tensor that owns its memory")
    for t, name in inputs:
        check(memory_sharing(out, t) != PARTIAL, lambda: f"{op}: {arg} partly overlaps an input ({name}); an output "
              "may be that input itself (the same view: in place) or memory apart from it")


def check_disjoint_outputs(a: torch.Tensor, b: torch.Tensor, op: str, arg_a: str, arg_b: str) -> None:
    check(memory_sharing(a, b) == NONE, lambda: f"{op}: {arg_a} and {arg_b} share memory; they must be separate tensors")


def check_eps(eps, op: str) -> None:
    check(eps >= 0.0, lambda: f"{op}: eps must be >= 0, got {number(eps)}")


# ---------------------------------------------------------------------------- norms (norm.h)


def parse_norm(norm: str, op: str) -> None:
    check(norm in ("rms", "layer"), lambda: f'{op}: norm must be "rms" or "layer", got "{norm}"')


class NormChecker:
    """norm_detail::Checker: checks every tensor a norm op touches against its input."""

    def __init__(self, op: str, input: torch.Tensor, device: Optional[str]):
        self.op, self.input, self.device = op, input, device
        self.dtype = input.dtype
        self.cols = self.tokens = 1
        self.weight_fp32 = False

    def check_input(self) -> None:
        op, x = self.op, self.input
        check_device(x, self.device, op, "input")
        check_float_dtype(x, op, "input")
        check(x.dim() >= 1, lambda: f"{op}: input must have at least 1 dim (the one normalised), got a 0-dim tensor")
        check(x.shape[-1] <= INT32_MAX, lambda: f"{op}: last dim {x.shape[-1]} is too large (at most 2^31 - 1)")
        self.cols = row_view(x, op, "input")[1]

    def like_input(self, t: torch.Tensor, arg: str, dtype: torch.dtype) -> None:
        """Same sizes and device as the input; dtype as given."""
        op, x = self.op, self.input
        check_same_device(t, x, op, arg, "input")
        check(t.dtype == dtype,
              lambda: f"{op}: {arg} has dtype {scalar_type_name(t.dtype)}; expected {scalar_type_name(dtype)}")
        check(same_sizes(t.shape, x.shape),
              lambda: f"{op}: {arg} has sizes {sizes(t.shape)} but input has sizes {sizes(x.shape)}")
        row_view(t, op, arg)

    def weight(self, w: Optional[torch.Tensor], fp32_allowed: bool) -> None:
        if w is None:
            return
        op, cols = self.op, self.cols
        check_same_device(w, self.input, op, "weight", "input")
        fp32 = w.dtype == torch.float32 and self.dtype in HALF_TYPES
        check(w.dtype == self.dtype or (fp32 and fp32_allowed),
              lambda: f"{op}: weight has dtype {scalar_type_name(w.dtype)} but input has dtype "
              f"{scalar_type_name(self.dtype)}"
              + (" (the weight may be the input's dtype or float32)"
                 if fp32_allowed and self.dtype != torch.float64 else ""))
        check(w.dim() == 1 and w.shape[0] == cols,
              lambda: f"{op}: weight must have shape [{cols}] (the input's last dim), got {sizes(w.shape)}")
        check(any_of(w.stride(0) == 1, cols <= 1), lambda: f"{op}: weight must be contiguous, got stride {w.stride(0)}")
        self.weight_fp32 = fp32

    def batch_tokens(self) -> None:
        """The input seen as [B, S, D]: 2-D input is [B, 1, D]."""
        x = self.input
        check(x.dim() in (2, 3), lambda: f"{self.op}: input must be [B, S, D] or [B, D], got sizes {sizes(x.shape)}")
        self.tokens = x.shape[1] if x.dim() == 3 else 1

    def modulation(self, m: torch.Tensor, arg: str) -> None:
        """[D], [B', D] or [B', S', D] with B' in {B, 1} and S' in {S, 1}; the input's dtype;
        a contiguous last dim."""
        op, cols, tokens = self.op, self.cols, self.tokens
        check_same_device(m, self.input, op, arg, "input")
        check(m.dtype == self.dtype, lambda: f"{op}: {arg} has dtype {scalar_type_name(m.dtype)} but input has dtype "
              f"{scalar_type_name(self.dtype)}")
        batch, d = self.input.shape[0], m.dim()
        check(1 <= d <= 3 and m.shape[-1] == cols,
              lambda: f"{op}: {arg} must be [D], [B, D] or [B, S, D] with D = {cols}, got sizes {sizes(m.shape)}")
        mb = m.shape[0] if d >= 2 else 1
        ms = m.shape[1] if d == 3 else 1
        check(all_of(any_of(mb == batch, mb == 1), any_of(ms == tokens, ms == 1)),
              lambda: f"{op}: {arg} with sizes {sizes(m.shape)} does not broadcast to input "
              f"[B={batch}, S={tokens}, D={cols}]")
        check(any_of(m.stride(-1) == 1, cols <= 1),
              lambda: f"{op}: {arg} must be contiguous in its last dim, got stride {m.stride(-1)}")

    def adaln(self, out, scale, shift, eps, norm: str, inputs: Sequence, stats=None) -> None:
        """The AdaLN part: norm kind and eps, scale and shift, and out."""
        op, x = self.op, self.input
        parse_norm(norm, op)
        check_eps(eps, op)
        self.modulation(scale, "scale")
        self.modulation(shift, "shift")
        self.like_input(out, "out", self.dtype)
        check_output_overlap(out, ((x, "input"), (scale, "scale"), (shift, "shift")), op, "out")
        check_output_overlap(out, inputs, op, "out")
        if stats is not None:
            self.check_stats(stats, "stats")

    def check_stats(self, t: torch.Tensor, arg: str) -> None:
        """Row statistics: fp32 [..., 2], contiguous, 8-byte aligned (allocations are)."""
        op = self.op
        check_same_device(t, self.input, op, arg, "input")
        want = (*self.input.shape[:-1], 2)
        check(t.dtype == torch.float32 and same_sizes(t.shape, want),
              lambda: f"{op}: {arg} must be float32 of sizes {sizes(want)} (each row's mean and rstd), got "
              f"{scalar_type_name(t.dtype)} {sizes(t.shape)}")
        check(t.is_contiguous() and t.storage_offset() * t.element_size() % 8 == 0,
              lambda: f"{op}: {arg} must be contiguous and 8-byte aligned")

    def grads(self, grad_out, grad_extra, grad_fp32_allowed: bool, grad_extra_name: str = "grad_extra") -> None:
        """backward_args: grad_out has the output's dtype (the input's, or fp32 beside an
        fp32 weight), grad_extra the input's."""
        op = self.op
        grad_fp32 = grad_out.dtype == torch.float32 and self.dtype in HALF_TYPES
        check(not grad_fp32 or grad_fp32_allowed, lambda: f"{op}: grad_out has dtype float32 but input has dtype "
              f"{scalar_type_name(self.dtype)} (a float32 grad_out needs a float32 weight)")
        self.like_input(grad_out, "grad_out", torch.float32 if grad_fp32 else self.dtype)
        if grad_extra is not None:
            self.like_input(grad_extra, grad_extra_name, self.dtype)


def rms_norm_out(device, out, input, weight, eps, op: str = "rms_norm") -> NormChecker:
    """rms_args: the RMSNorm part of rms_norm_out and fused_add_rms_norm_out."""
    c = NormChecker(op, input, device)
    c.check_input()
    c.weight(weight, fp32_allowed=True)
    check_eps(eps, op)
    dtype = input.dtype
    out_fp32 = out.dtype == torch.float32 and dtype in HALF_TYPES
    check(out.dtype == dtype or out_fp32,
          lambda: f"{op}: out has dtype {scalar_type_name(out.dtype)} but input has dtype {scalar_type_name(dtype)}"
          + ("" if dtype == torch.float64 else " (out may be the input's dtype or float32)"))
    check(not out_fp32 or c.weight_fp32, lambda: f"{op}: a float32 out needs a float32 weight")
    c.like_input(out, "out", out.dtype)
    check_output_overlap(out, ((input, "input"), (weight, "weight")), op, "out")
    return c


def fused_add_rms_norm_out(device, out, residual_out, input, residual, weight, eps) -> None:
    op = "fused_add_rms_norm"
    c = rms_norm_out(device, out, input, weight, eps, op)
    c.like_input(residual, "residual", input.dtype)
    c.like_input(residual_out, "residual_out", input.dtype)
    check_disjoint_outputs(out, residual_out, op, "out", "residual_out")
    check_output_overlap(out, ((residual, "residual"),), op, "out")
    check_output_overlap(residual_out, ((input, "input"), (residual, "residual")), op, "residual_out")
    if weight is not None:  # the sum would overwrite the weight before the norm reads it
        check_disjoint_outputs(residual_out, weight, op, "residual_out", "weight")


def adaln_out(device, out, input, scale, shift, eps, norm) -> None:
    c = NormChecker("adaln", input, device)
    c.check_input()
    c.batch_tokens()
    c.adaln(out, scale, shift, eps, norm, ())


def gated_residual_out(device, residual_out, out, residual, input, gate, scale=None, shift=None, eps=0.0,
                       norm: str = "") -> None:
    """residual_out = residual + input * gate; with out, scale and shift also the AdaLN of it."""
    op = "gated_residual"
    c = NormChecker(op, input, device)
    c.check_input()
    c.batch_tokens()
    c.like_input(residual, "residual", input.dtype)
    c.like_input(residual_out, "residual_out", input.dtype)
    check_output_overlap(residual_out, ((input, "input"), (residual, "residual"), (gate, "gate")), op, "residual_out")
    c.modulation(gate, "gate")
    if out is not None:
        check_disjoint_outputs(out, residual_out, op, "out", "residual_out")
        # A row's residual_out is stored before its scale and shift are read.
        check_disjoint_outputs(residual_out, scale, op, "residual_out", "scale")
        check_disjoint_outputs(residual_out, shift, op, "residual_out", "shift")
        c.adaln(out, scale, shift, eps, norm, ((residual, "residual"), (gate, "gate")))


def rms_norm_backward(device, grad_out, input, weight, eps, grad_extra) -> None:
    op = "rms_norm_backward"
    c = NormChecker(op, input, device)
    c.check_input()
    c.weight(weight, fp32_allowed=True)
    check_eps(eps, op)
    c.grads(grad_out, grad_extra, grad_fp32_allowed=c.weight_fp32)


def _adaln_backward_args(c: NormChecker, grad_out, scale, shift, eps, norm, grad_extra, stats,
                         grad_extra_name: str) -> None:
    c.check_input()
    c.batch_tokens()
    parse_norm(norm, c.op)
    check_eps(eps, c.op)
    c.modulation(scale, "scale")
    c.modulation(shift, "shift")
    c.grads(grad_out, grad_extra, grad_fp32_allowed=False, grad_extra_name=grad_extra_name)
    if stats is not None:
        c.check_stats(stats, "stats")


def adaln_backward(device, grad_out, input, scale, shift, eps, norm, grad_extra, stats) -> None:
    c = NormChecker("adaln_backward", input, device)
    _adaln_backward_args(c, grad_out, scale, shift, eps, norm, grad_extra, stats, "grad_extra")


def gated_residual_adaln_backward(device, grad_out, grad_residual_out, residual_out, input, gate, scale, shift, eps,
                                  norm, stats) -> None:
    c = NormChecker("gated_residual_adaln_backward", input, device)
    _adaln_backward_args(c, grad_out, scale, shift, eps, norm, grad_residual_out, stats, "grad_residual_out")
    c.like_input(residual_out, "residual_out", input.dtype)
    c.modulation(gate, "gate")


def gated_residual_backward(device, grad_out, input, gate) -> None:
    c = NormChecker("gated_residual_backward", input, device)
    c.check_input()
    c.batch_tokens()
    c.modulation(gate, "gate")
    c.grads(grad_out, None, grad_fp32_allowed=False)


# ---------------------------------------------------------------------------- activations (activation.h)


def parse_gelu(approximate: str, op: str) -> None:
    check(approximate in ("none", "tanh"), lambda: f'{op}: approximate must be "none" or "tanh", got "{approximate}"')


def activation(device, op: str, out, gate, up, approximate: str, gate_arg: str = "input", grad=None,
               up_grad=None) -> None:
    """run_checked: out = gelu(gate) [* up], or the backward with grad; every tensor of one
    shape, dtype and device. gate_arg is what the op's messages call gate."""
    check_device(gate, device, op, gate_arg)
    check_float_dtype(gate, op, gate_arg)
    check(gate.dim() >= 1, lambda: f"{op}: {gate_arg} must have at least 1 dim")
    parse_gelu(approximate, op)
    cols = row_view(gate, op, gate_arg)[1]
    check(cols <= INT32_MAX, lambda: f"{op}: last dim {cols} is too large (at most 2^31 - 1)")
    others = [(t, arg) for t, arg in ((out, "out"), (up, "up"), (grad, "grad"), (up_grad, "up_grad")) if t is not None]
    for t, arg in others:
        check_same_device(t, gate, op, arg, gate_arg)
        check(t.dtype == gate.dtype, lambda: f"{op}: {arg} has dtype {scalar_type_name(t.dtype)} but {gate_arg} has "
              f"dtype {scalar_type_name(gate.dtype)}")
        check(same_sizes(t.shape, gate.shape),
              lambda: f"{op}: {arg} has sizes {sizes(t.shape)} but expected {sizes(gate.shape)}")
    check_output_overlap(out, ((gate, gate_arg), (up, "up")), op, "out")
    for t, arg in others:
        row_view(t, op, arg)


def check_geglu_input(input, op: str) -> None:
    check(input.dim() >= 1 and input.shape[-1] % 2 == 0,
          lambda: f"{op}: input's last dim must be even ([..., 2H]: value then gate), got sizes {sizes(input.shape)}")


def geglu_halves(input):
    """(value, gate): the two halves of [..., 2H]."""
    h = input.shape[-1] // 2
    return input.narrow(-1, 0, h), input.narrow(-1, h, h)


def geglu_out(device, out, input, approximate) -> None:
    op = "geglu"
    check_geglu_input(input, op)
    value, gate = geglu_halves(input)
    activation(device, op, out, gate, value, approximate)


# ---------------------------------------------------------------------------- RoPE (rope.h)


def _as_bhsd(t, sequence_dim, op: str, arg: str):
    """t as [B, H, S, D] sizes."""
    check(t.dim() in (3, 4),
          lambda: f"{op}: {arg} must be [B, S, C], [B, H, S, D] or [B, S, H, D], got sizes {sizes(t.shape)}")
    check(any_of(t.stride(-1) == 1, t.shape[-1] <= 1),
          lambda: f"{op}: {arg} must be contiguous in its last dim, got strides {sizes(t.stride())}")
    if t.dim() == 3:
        check(sequence_dim == 1, lambda: f"{op}: sequence_dim must be 1 for a 3-D {arg} ([B, S, C]), got {sequence_dim}")
        return t.shape[0], 1, t.shape[1], t.shape[2]
    check(sequence_dim in (1, 2), lambda: f"{op}: sequence_dim must be 1 ([B, S, H, D]) or 2 ([B, H, S, D]), got "
          f"{sequence_dim}")
    return t.shape[0], t.shape[3 - sequence_dim], t.shape[sequence_dim], t.shape[3]


def _check_tables(cos, sin, x, batch, seq, op: str, x_name: str = "q"):
    """cos and sin: [S, R] or [B, S, R] of x's dtype or float32, one layout for both;
    returns R."""
    for t, arg in ((cos, "cos"), (sin, "sin")):
        check_same_device(t, x, op, arg, x_name)
        check(t.dtype == x.dtype or (t.dtype == torch.float32 and x.dtype in HALF_TYPES),
              lambda: f"{op}: {arg} has dtype {scalar_type_name(t.dtype)}; expected {x_name}'s dtype "
              f"({scalar_type_name(x.dtype)})" + ("" if x.dtype == torch.float64 else " or float32"))
        check(t.dim() in (2, 3), lambda: f"{op}: {arg} must be [S, R] or [B, S, R], got sizes {sizes(t.shape)}")
        check(any_of(t.stride(-1) == 1, t.shape[-1] <= 1), lambda: f"{op}: {arg} must be contiguous in its last dim")
    check(cos.dtype == sin.dtype and all_of(same_sizes(cos.shape, sin.shape), same_sizes(cos.stride(), sin.stride())),
          lambda: f"{op}: cos and sin must share sizes, strides and dtype, got {sizes(cos.shape)}{sizes(cos.stride())} "
          f"and {sizes(sin.shape)}{sizes(sin.stride())}")
    table_batch = cos.shape[0] if cos.dim() == 3 else 1
    check(all_of(cos.shape[-2] == seq, any_of(table_batch == batch, table_batch == 1)),
          lambda: f"{op}: cos has sizes {sizes(cos.shape)}; expected [S, R] or [B, S, R] with B = {batch}, S = {seq}")
    return cos.shape[-1]


def _check_outputs_apart(q_out, k_out, q, k, shared, op: str) -> None:
    """Neither output may share memory with the other tensor or with `shared` (tables,
    weights): other heads and rows still read those after an output element is written."""
    check_disjoint_outputs(q_out, k, op, "q_out", "k")
    check_disjoint_outputs(k_out, q, op, "k_out", "q")
    for t, arg in shared:
        check_disjoint_outputs(q_out, t, op, "q_out", arg)
        check_disjoint_outputs(k_out, t, op, "k_out", arg)


def rope_apply(device, q_out, k_out, q, k, cos, sin, sequence_dim, inverse: bool = False) -> None:
    op = "rope_backward" if inverse else "rope"
    q_name, k_name = ("grad_q", "grad_k") if inverse else ("q", "k")  # the op's schema names
    check_device(q, device, op, q_name)
    check_float_dtype(q, op, q_name)
    batch, _, seq, head_dim = _as_bhsd(q, sequence_dim, op, q_name)
    for t, arg in ((k, k_name), (q_out, "q_out"), (k_out, "k_out")):
        check_same_device(t, q, op, arg, q_name)
        check(t.dtype == q.dtype, lambda: f"{op}: {arg} has dtype {scalar_type_name(t.dtype)} but {q_name} has dtype "
              f"{scalar_type_name(q.dtype)}")
    check(k.dim() == q.dim(), lambda: f"{op}: {k_name} has sizes {sizes(k.shape)} but {q_name} has sizes "
          f"{sizes(q.shape)}")
    k_batch, _, k_seq, k_head_dim = _as_bhsd(k, sequence_dim, op, k_name)
    check(all_of(k_batch == batch, k_seq == seq, k_head_dim == head_dim),
          lambda: f"{op}: {k_name} has sizes {sizes(k.shape)} but {q_name} has sizes {sizes(q.shape)} (batch, "
          "sequence and head dim must agree; heads may differ)")
    for t, arg, like, like_arg in ((q_out, "q_out", q, "q"), (k_out, "k_out", k, "k")):
        check(same_sizes(t.shape, like.shape),
              lambda: f"{op}: {arg} has sizes {sizes(t.shape)} but {like_arg} has sizes {sizes(like.shape)}")
    inputs = ((q, q_name), (k, k_name), (cos, "cos"), (sin, "sin"))
    check_output_overlap(q_out, inputs, op, "q_out")
    check_output_overlap(k_out, inputs, op, "k_out")
    check_disjoint_outputs(q_out, k_out, op, "q_out", "k_out")
    _check_outputs_apart(q_out, k_out, q, k, ((cos, "cos"), (sin, "sin")), op)
    _as_bhsd(q_out, sequence_dim, op, "q_out")
    _as_bhsd(k_out, sequence_dim, op, "k_out")
    rotary_dim = _check_tables(cos, sin, q, batch, seq, op, q_name)
    # (an empty head dim rotates nothing: empty tables)
    check(all_of(rotary_dim % 2 == 0, rotary_dim <= head_dim, any_of(rotary_dim > 0, head_dim == 0)),
          lambda: f"{op}: cos's last dim (the rotary dim) must be even and in [2, {head_dim}], got {rotary_dim}")


def qk_norm_rope_out(device, q_out, k_out, q, k, q_weight, k_weight, cos, sin, eps) -> None:
    op = "qk_norm_rope"
    check_device(q, device, op, "q")
    check_float_dtype(q, op, "q")
    check(q.dim() == 3, lambda: f"{op}: q must be [B, S, C], got sizes {sizes(q.shape)}")
    batch, seq, channels = q.shape
    max_row_bytes = QK_NORM_ROPE_CUDA_MAX_ROW_BYTES if device == "cuda" else INT64_MAX
    check(all_of(channels % 2 == 0, channels * q.element_size() <= max_row_bytes),
          lambda: f"{op}: C must be even and at most {max_row_bytes // q.element_size()} for "
          f"{scalar_type_name(q.dtype)}, got {channels}")
    for t, arg in ((k, "k"), (q_out, "q_out"), (k_out, "k_out")):
        check_same_device(t, q, op, arg, "q")
        check(t.dtype == q.dtype, lambda: f"{op}: {arg} has dtype {scalar_type_name(t.dtype)} but q has dtype "
              f"{scalar_type_name(q.dtype)}")
        check(same_sizes(t.shape, q.shape), lambda: f"{op}: {arg} has sizes {sizes(t.shape)} but q has sizes "
              f"{sizes(q.shape)}")
    for t, arg in ((q_weight, "q_weight"), (k_weight, "k_weight")):
        check_same_device(t, q, op, arg, "q")
        check(t.dtype == q.dtype, lambda: f"{op}: {arg} has dtype {scalar_type_name(t.dtype)} but q has dtype "
              f"{scalar_type_name(q.dtype)}")
        check(t.dim() == 1 and all_of(t.shape[0] == channels, any_of(t.stride(0) == 1, channels <= 1)),
              lambda: f"{op}: {arg} must be a contiguous [{channels}], got sizes {sizes(t.shape)}")
    check_eps(eps, op)
    rotary_dim = _check_tables(cos, sin, q, batch, seq, op)
    check(rotary_dim == channels, lambda: f"{op}: cos's last dim must be C = {channels}, got {rotary_dim}")
    inputs = ((q, "q"), (k, "k"), (cos, "cos"), (sin, "sin"))
    check_output_overlap(q_out, inputs, op, "q_out")
    check_output_overlap(k_out, inputs, op, "k_out")
    check_disjoint_outputs(q_out, k_out, op, "q_out", "k_out")
    _check_outputs_apart(q_out, k_out, q, k, ((cos, "cos"), (sin, "sin"), (q_weight, "q_weight"),
                                              (k_weight, "k_weight")), op)
    row_strides = [row_view(t, op, arg)[2] for t, arg in ((q, "q"), (k, "k"), (q_out, "q_out"), (k_out, "k_out"))]
    if device == "cuda" and not surely(batch * seq == 0) and not surely(channels == 0):
        _qk_norm_rope_cuda_launch(q_out, k_out, q, k, q_weight, k_weight, cos, sin, row_strides)


def _aligned(t: torch.Tensor, bytes_: int):
    """The tensor's data pointer is a multiple of bytes_ (its storage's is: allocations are)."""
    return t.storage_offset() * t.element_size() % bytes_ == 0


def _qk_norm_rope_cuda_launch(q_out, k_out, q, k, q_weight, k_weight, cos, sin, row_strides) -> None:
    """The CUDA launcher's limits (rope.cu): a row stays in the registers of at most 512
    threads x 4 vectors, of 16 bytes where every pointer and stride allows, else of 2
    elements; and 2 * B * S rows must fit an int32."""
    op = "qk_norm_rope"
    batch, seq, channels = q.shape
    vec = 16 // q.element_size()
    table_vec_bytes = vec * cos.element_size()
    # Where sizes cannot tell, the vector path: the fake refuses only what the kernel would.
    vector = not surely(sym_not(all_of(
        channels % vec == 0, _aligned(cos, table_vec_bytes), _aligned(sin, table_vec_bytes),
        cos.dim() < 3 or any_of(cos.shape[0] == 1, cos.stride(0) % vec == 0), cos.stride(-2) % vec == 0,
        *(_aligned(t, 16) for t in (q, k, q_weight, k_weight, q_out, k_out)),
        *(stride % vec == 0 for stride in row_strides))))
    check(channels <= 2048 * (vec if vector else 2),
          lambda: f"{op}: C = {channels} is too wide for the kernel's registers with these alignments")
    rows = batch * seq
    check(2 * rows <= INT32_MAX, lambda: f"{op}: at most 2^30 - 1 tokens (B * S) on CUDA, got {rows}")


# ---------------------------------------------------------------------------- FP8 producers (fp8.h)


def fp8_capability(device: Optional[str], op: str) -> None:
    """check_fp8_cuda_capability: FP8 needs sm_89+. Without a GPU (fake CUDA tensors) the
    capability is unknown, and the real call decides."""
    if device != "cuda" or not torch.cuda.is_available():
        return
    major, minor = torch.cuda.get_device_capability()
    check(major * 10 + minor >= 89, lambda: f"{op}: FP8 needs a GPU of compute capability 8.9 or newer (found "
          f"{major}.{minor})")


def fp8_input(device: Optional[str], x: torch.Tensor, op: str, arg: str = "input") -> None:
    """fp8_detail::check_input: device, the GPU's capability, dtype (no float64), rank."""
    check_device(x, device, op, arg)
    fp8_capability(device, op)
    check(x.dtype in FLOAT_TYPES, lambda: f"{op}: {arg} has dtype {scalar_type_name(x.dtype)}; expected float32, "
          "float16 or bfloat16")
    check(x.dim() >= 1, lambda: f"{op}: {arg} must have at least 1 dim, got a 0-dim tensor")
    check(x.shape[-1] <= INT32_MAX, lambda: f"{op}: last dim {x.shape[-1]} is too large (at most 2^31 - 1)")


def fp8_static_scale(scale: torch.Tensor, x: torch.Tensor, op: str, arg: str = "scale",
                     input_arg: str = "input") -> None:
    check_same_device(scale, x, op, arg, input_arg)
    check(all_of(scale.dtype == torch.float32, scale.numel() == 1),
          lambda: f"{op}: {arg} must be a float32 tensor of one element (the whole tensor's scale), got "
          f"{scalar_type_name(scale.dtype)} of sizes {sizes(scale.shape)}")


def gelu_fp8(device, op: str, gate, up, approximate: str, scale, gate_arg: str) -> None:
    """fp8_detail::gelu_fp8: gate as an FP8 input, the GELU form, up, the static scale."""
    fp8_input(device, gate, op, gate_arg)
    parse_gelu(approximate, op)
    if up is not None:
        check_same_device(up, gate, op, "up", gate_arg)
        check(up.dtype == gate.dtype, lambda: f"{op}: up has dtype {scalar_type_name(up.dtype)} but {gate_arg} has "
              f"dtype {scalar_type_name(gate.dtype)}")
        check(same_sizes(up.shape, gate.shape),
              lambda: f"{op}: up has sizes {sizes(up.shape)} but expected {sizes(gate.shape)}")
    if scale is not None:
        fp8_static_scale(scale, gate, op, "scale", gate_arg)
    row_view(gate, op, gate_arg)
    if up is not None:
        row_view(up, op, "up")


def geglu_fp8(device, op: str, input, approximate: str, scale) -> None:
    fp8_input(device, input, op)
    check_geglu_input(input, op)
    value, gate = geglu_halves(input)
    gelu_fp8(device, op, gate, value, approximate, scale, "input")


# ---------------------------------------------------------------------------- nested tensors


def refuses_nested(op: str, advice: str):
    """Wraps a functional form: a nested tensor among its arguments gets an error naming
    the op and what to do, instead of whatever the nested tensor's dispatch says about the
    op's internal name. Checked only once the call has failed: free when it has not."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception:
                if not any(_is_nested(a) for a in (*args, *kwargs.values())):
                    raise
            raise RuntimeError(f"{op}: nested tensors (torch.nested) are not supported; {advice}")

        return call

    return wrap


def _is_nested(a) -> bool:
    if isinstance(a, (tuple, list)):
        return any(_is_nested(t) for t in a)
    return isinstance(a, torch.Tensor) and a.is_nested


# What to do with a nested tensor: row-wise ops run on the packed rows; ops that pair rows
# with per-sequence or per-position operands need a dense batch.
ROWS_ADVICE = ("for a jagged [B, j, D] tensor nt, call it on nt.values() (the packed [sum(j), D] rows) and "
               "rebuild with torch.nested.nested_tensor_from_jagged(out, nt.offsets())")
DENSE_ADVICE = "pass a dense batch (nt.to_padded_tensor(0.0)) or call it per sequence (nt.unbind())"
