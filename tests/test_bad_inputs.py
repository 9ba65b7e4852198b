"""Bad input, generated from a table: every public function, its out-variant and the
layers, with one tensor argument at a time given the wrong device, dtype, rank, shape,
strides, alignment, or memory shared with an input (directly or through strided views),
plus whole-call variations (empty, an empty last dim, rows longer than a CUDA block holds,
NaN/Inf) and autograd misuse (outputs that require grad or are inference tensors, written
tensors that a backward saved, dual tensors, double backward).

Each case expects one of two outcomes and nothing else: a RuntimeError (or ValueError,
TypeError) whose message names the argument, or the fp64 reference's result (NaN and Inf
where the reference has them). Cases run on every target of conftest.py; GPU-only cases
(devices) skip without a GPU. The module prints how many cases ran at the end.

Below the matrix, every op registered in the build's namespace (kernel.ops: the backward
ops and the forwards with statistics too) is walked with wrong dtypes, devices, shapes and
overlapping outputs: each call refuses cleanly or gives its own float64 run's result."""

import contextlib
import re
import zlib
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Callable, Optional

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from conftest import HAS_GPU
from reference import TOLERANCE, rms_norm_ref, rope_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
EPS = 1e-6
# Longer than any CUDA block keeps in registers (1024 threads x 4 vectors x 8 bf16 =
# 32768; 4096 on the scalar path): the rest of the row is re-read.
HUGE_D = 40_000


@dataclass(frozen=True)
class Dims:
    b: int = 2
    s: int = 3
    d: int = 64  # last dim (rope: head dim)
    heads: int = 2
    rotary: int = 12  # rope only: a partial rotary dim


@dataclass(frozen=True)
class Arg:
    key: str  # name in the case's tensor dict (and keyword of the Python API)
    says: str  # what the op's error messages call it
    kind: str  # layout family: rows, weight, mod, heads, table
    output: bool = False
    owner: Optional[str] = None  # outputs: the input they may be (in place)
    # (arg dtype, primary dtype) -> accepted; default: the same dtype
    accepts: Callable[[torch.dtype, torch.dtype], bool] = lambda a, p: a == p


def fp32_or_same(a, p):
    return a == p or a == torch.float32


@dataclass(frozen=True)
class Api:
    name: str
    args: tuple
    make: Callable  # (Dims, dtype, device) -> {key: tensor}, a valid call
    call: Callable  # (kernel, tensors) -> outputs
    ref: Callable  # tensors -> [(fp64 expected, output dtype)] per output
    roundings: int = 1
    atol_ulps: float = 0.0  # absolute error in ulps of the input dtype, for cancellation
    row_local: bool = True  # every row is read before it is written: outputs may alias any input...
    apart: tuple = ()  # ...but these (output, input) pairs: the output is stored before the input is read
    bad_primary_ranks: tuple = ()
    # CUDA keeps a whole row in registers (qk_norm_rope): C up to 16384, or 4096 unaligned
    cuda_row_limit: bool = False
    takes_float64: bool = True  # the CPU ops take an all-float64 call (FP8 has no float64 form)
    rtol: float = 0.0  # at least these tolerances, whatever the input dtype
    atol: float = 0.0

    @property
    def primary(self) -> Arg:
        return self.args[0]


@dataclass(frozen=True)
class Refuse:
    names: tuple  # the message must name one of these
    error: type = RuntimeError


REFERENCE = "reference"


@dataclass(frozen=True)
class Bumped:
    """The reference's result, and each of these tensors' version counter went up (autograd
    then refuses a backward that saved one of them before the write)."""
    keys: tuple


def rand(shape, dtype, device, scale=1.0, offset=0.0):
    return (torch.randn(shape) * scale + offset).to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------- references


def norm_ref(x, eps, kind):
    x64 = x.double()
    if kind == "rms":
        return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    centred = x64 - x64.mean(-1, keepdim=True)
    return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)


def per_row(m, x):
    """A [D], [B, D], [B, 1, D] or [B, S, D] operand broadcast against x [B, S, D] / [B, D]."""
    m = m.double()
    if x.dim() == 3 and m.dim() == 2:
        return m[:, None]
    if x.dim() == 2 and m.dim() == 3:
        return m[:, 0]
    return m


def adaln_ref(x, scale, shift, kind):
    return norm_ref(x, EPS, kind) * (1 + per_row(scale, x)) + per_row(shift, x)


def gated_ref(residual, x, gate):
    return (residual.double() + x.double() * per_row(gate, x)).to(x.dtype)


def qk_ref(t):
    out = []
    for x, w in ((t["q"], t["q_weight"]), (t["k"], t["k_weight"])):
        # The explicit fp64 formula, as every other reference here, not ATen's rms_norm,
        # whose CUDA kernel may treat a row holding an Inf differently from its CPU one.
        normed = rms_norm_ref(x, w, 1e-5).to(x.dtype)
        out.append((rope_ref(normed[:, None], t["cos"], t["sin"], True)[:, 0], x.dtype))
    return out


def gelu_ref(x, approximate):
    return F.gelu(x.double(), approximate=approximate)


def rope_tables(b, s, r, dtype, device, interleaved):
    """Real cos/sin tables [B, S, R] (cos^2 + sin^2 = 1), as the hosts build them."""
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / max(r, 1)))
    angle = (torch.arange(s, dtype=torch.float64)[:, None] + torch.arange(b, dtype=torch.float64)[:, None, None]) * inv
    angle = angle.repeat_interleave(2, -1) if interleaved else torch.cat([angle, angle], -1)
    return angle.cos().to(device=device, dtype=dtype), angle.sin().to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------- the table

ROWS_IN = Arg("x", "input", "rows")
OUT = Arg("out", "out", "rows", output=True, owner="x")
WEIGHT = Arg("weight", "weight", "weight", accepts=fp32_or_same)


def make_rows(*keys, scale=2.0):
    def make(dims, dtype, device):
        return {k: rand((dims.b, dims.s, dims.d), dtype, device, scale) for k in keys}
    return make


def with_weight(make_base):
    def make(dims, dtype, device):
        return {**make_base(dims, dtype, device), "weight": rand((dims.d,), dtype, device)}
    return make


def with_outputs(make_base, *keys, like="x"):
    """Adds output buffers (NaN-filled: every element must be written)."""
    def make(dims, dtype, device):
        t = make_base(dims, dtype, device)
        return {**t, **{k: torch.full_like(t[like], float("nan")) for k in keys}}
    return make


def make_mod(keys):
    """x [B, S, D] with an offset mean (LayerNorm must centre), modulations ~0.3 per token."""
    def make(dims, dtype, device):
        t = {"x": rand((dims.b, dims.s, dims.d), dtype, device, 2.0, 0.5)}
        for k in keys:
            t[k] = rand((dims.b, dims.s, dims.d), dtype, device, 1.0 if k == "residual" else 0.3)
        return t
    return make


def make_rope(interleaved):
    def make(dims, dtype, device):
        q = rand((dims.b, dims.heads, dims.s, dims.d), dtype, device, 2.0)
        k = rand((dims.b, dims.heads, dims.s, dims.d), dtype, device, 2.0)
        cos, sin = rope_tables(dims.b, dims.s, min(dims.rotary, dims.d), dtype, device, interleaved)
        return {"q": q, "k": k, "cos": cos, "sin": sin}
    return make


def make_qk(dims, dtype, device):
    q, k = (rand((dims.b, dims.s, dims.d), dtype, device, 2.0) for _ in range(2))
    cos, sin = rope_tables(dims.b, dims.s, dims.d, dtype, device, interleaved=True)
    return {"q": q, "k": k, "q_weight": rand((dims.d,), dtype, device), "k_weight": rand((dims.d,), dtype, device),
            "cos": cos, "sin": sin}


def make_geglu(dims, dtype, device):
    return {"x": rand((dims.b, dims.s, 2 * dims.d), dtype, device, 2.0)}


def make_geglu_out(dims, dtype, device):
    return {**make_geglu(dims, dtype, device),
            "out": torch.full((dims.b, dims.s, dims.d), float("nan"), dtype=dtype, device=device)}


def rms_ref(t):
    return [(rms_norm_ref(t["x"], t.get("weight"), EPS), t["x"].dtype)]


def fused_ref(t):
    h = (t["x"].double() + t["residual"].double()).to(t["x"].dtype)
    return [(rms_norm_ref(h, t.get("weight"), EPS), h.dtype), (h.double(), h.dtype)]


def gated_adaln_ref(t):
    h = gated_ref(t["residual"], t["x"], t["gate"])
    return [(h.double(), h.dtype), (adaln_ref(h, t["scale"], t["shift"], "rms"), h.dtype)]


def layer_rms_ref(t):
    x, w = t["x"], t["weight"]
    if x.dtype == torch.float32 and w.dtype in (torch.float16, torch.bfloat16):
        w = w.float()
    return [(rms_norm_ref(x, w, EPS, cast_before_weight=True), torch.promote_types(w.dtype, x.dtype))]


def layer_rms_accepts(a, p):
    """transformers' Llama order: activations and weight of any of the kernels' dtypes; a
    weight of another dtype promotes the product to fp32, as the host's does."""
    kernel_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    return a in kernel_dtypes and p in kernel_dtypes


class _HostRefused(RuntimeError, ValueError):
    """Raised by the stand-in host: an instance of either error type a refusal may expect."""


class _Host(SimpleNamespace):
    """Stands for the host module. The layers hand what they do not support to the host's
    own forward (`layers._host(self).forward`); this one refuses, naming the input and its
    tensor attributes (the weight), so such a case
    shows up as a refusal rather than as the host's (untested here) result."""

    def forward(self, x):
        if x.numel() == 0 and x.is_floating_point():  # what any row-wise host returns for no rows
            return torch.empty_like(x)
        operands = "".join(f", {name} of dtype {v.dtype}" for name, v in vars(self).items() if isinstance(v, torch.Tensor))
        raise _HostRefused(f"host forward: input of dtype {x.dtype} and sizes {tuple(x.shape)}{operands} left to the host")


def call_layer(layer_class, attrs):
    def call(kernel, t):
        host = _Host(**{name: t[key] if key in t else key for name, key in attrs.items()})
        return (getattr(kernel.layers, layer_class).forward(host, t["x"]),)
    return call


MOD = dict(kind="mod")
NORM_APIS = [
    Api("rms_norm", (ROWS_IN, WEIGHT), with_weight(make_rows("x", scale=3.0)),
        lambda k, t: (k.rms_norm(t["x"], t["weight"], EPS),), rms_ref),
    Api("rms_norm[out]", (ROWS_IN, WEIGHT, OUT), with_outputs(with_weight(make_rows("x", scale=3.0)), "out"),
        lambda k, t: (k.rms_norm(t["x"], t["weight"], EPS, out=t["out"]),), rms_ref),
    Api("fused_add_rms_norm", (ROWS_IN, Arg("residual", "residual", "rows"), WEIGHT),
        with_weight(make_rows("x", "residual")),
        lambda k, t: k.fused_add_rms_norm(t["x"], t["residual"], t["weight"], EPS), fused_ref),
    Api("fused_add_rms_norm[out]",
        (ROWS_IN, Arg("residual", "residual", "rows"), WEIGHT, OUT,
         Arg("residual_out", "residual_out", "rows", output=True, owner="residual")),
        with_outputs(with_weight(make_rows("x", "residual")), "out", "residual_out"),
        lambda k, t: k.fused_add_rms_norm(t["x"], t["residual"], t["weight"], EPS, out=t["out"],
                                          residual_out=t["residual_out"]), fused_ref),
    Api("adaln", (ROWS_IN, Arg("scale", "scale", **MOD), Arg("shift", "shift", **MOD)), make_mod(("scale", "shift")),
        lambda k, t: (k.adaln(t["x"], t["scale"], t["shift"], EPS),),
        lambda t: [(adaln_ref(t["x"], t["scale"], t["shift"], "layer"), t["x"].dtype)],
        atol_ulps=1, bad_primary_ranks=(1, 4)),
    Api("adaln[out]", (ROWS_IN, Arg("scale", "scale", **MOD), Arg("shift", "shift", **MOD), OUT),
        with_outputs(make_mod(("scale", "shift")), "out"),
        lambda k, t: (k.adaln(t["x"], t["scale"], t["shift"], EPS, norm="rms", out=t["out"]),),
        lambda t: [(adaln_ref(t["x"], t["scale"], t["shift"], "rms"), t["x"].dtype)],
        atol_ulps=1, bad_primary_ranks=(1, 4)),
    Api("gated_residual", (ROWS_IN, Arg("residual", "residual", "rows"), Arg("gate", "gate", **MOD)),
        make_mod(("residual", "gate")),
        lambda k, t: (k.gated_residual(t["residual"], t["x"], t["gate"]),),
        lambda t: [(gated_ref(t["residual"], t["x"], t["gate"]).double(), t["x"].dtype)], bad_primary_ranks=(1, 4)),
    Api("gated_residual[out]",
        (ROWS_IN, Arg("residual", "residual", "rows"), Arg("gate", "gate", **MOD),
         Arg("out", "residual_out", "rows", output=True, owner="residual")),
        with_outputs(make_mod(("residual", "gate")), "out"),
        lambda k, t: (k.gated_residual(t["residual"], t["x"], t["gate"], out=t["out"]),),
        lambda t: [(gated_ref(t["residual"], t["x"], t["gate"]).double(), t["x"].dtype)], bad_primary_ranks=(1, 4)),
    Api("gated_residual_adaln",
        (ROWS_IN, Arg("residual", "residual", "rows"), Arg("gate", "gate", **MOD), Arg("scale", "scale", **MOD),
         Arg("shift", "shift", **MOD)),
        make_mod(("residual", "gate", "scale", "shift")),
        lambda k, t: k.gated_residual_adaln(t["residual"], t["x"], t["gate"], t["scale"], t["shift"], EPS, norm="rms"),
        gated_adaln_ref, atol_ulps=1, bad_primary_ranks=(1, 4)),
    Api("gated_residual_adaln[out]",
        (ROWS_IN, Arg("residual", "residual", "rows"), Arg("gate", "gate", **MOD), Arg("scale", "scale", **MOD),
         Arg("shift", "shift", **MOD), Arg("residual_out", "residual_out", "rows", output=True, owner="residual"),
         OUT),
        with_outputs(make_mod(("residual", "gate", "scale", "shift")), "residual_out", "out"),
        lambda k, t: k.gated_residual_adaln(t["residual"], t["x"], t["gate"], t["scale"], t["shift"], EPS, norm="rms",
                                            residual_out=t["residual_out"], out=t["out"]),
        gated_adaln_ref, atol_ulps=1, bad_primary_ranks=(1, 4),
        apart=(("residual_out", "scale"), ("residual_out", "shift"))),
]

QK = (Arg("q", "q", "heads"), Arg("k", "k", "heads"), Arg("cos", "cos", "table", accepts=fp32_or_same),
      Arg("sin", "sin", "table", accepts=fp32_or_same))
QK_OUT = (Arg("q_out", "q_out", "heads", output=True, owner="q"), Arg("k_out", "k_out", "heads", output=True, owner="k"))


def rope_api(name, interleaved, fn):
    def reference(t):
        return [(rope_ref(t[x], t["cos"], t["sin"], interleaved), t[x].dtype) for x in ("q", "k")]

    rope_kw = dict(row_local=False, bad_primary_ranks=(2, 5))
    return [
        Api(name, QK, make_rope(interleaved), lambda k, t: getattr(k, fn)(t["q"], t["k"], t["cos"], t["sin"]),
            reference, **rope_kw),
        Api(f"{name}[inplace]", QK, make_rope(interleaved),
            lambda k, t: getattr(k, fn)(t["q"], t["k"], t["cos"], t["sin"], inplace=True), reference, **rope_kw),
        Api(f"{name}[out]", QK + QK_OUT,
            lambda dims, dtype, device: {**(t := make_rope(interleaved)(dims, dtype, device)),
                                         "q_out": torch.full_like(t["q"], float("nan")),
                                         "k_out": torch.full_like(t["k"], float("nan"))},
            lambda k, t: getattr(k, fn)(t["q"], t["k"], t["cos"], t["sin"], out=(t["q_out"], t["k_out"])),
            reference, **rope_kw),
    ]


QK_NORM = (Arg("q", "q", "rows"), Arg("k", "k", "rows"), Arg("q_weight", "q_weight", "weight"),
           Arg("k_weight", "k_weight", "weight"), Arg("cos", "cos", "table", accepts=fp32_or_same),
           Arg("sin", "sin", "table", accepts=fp32_or_same))
# Two roundings (the normed value, as torch.nn.RMSNorm returns it, then the rotation);
# where the rotation's terms cancel, a tie of the first rounding shows as one ulp of |normed|.
QK_KW = dict(roundings=3, atol_ulps=4, row_local=False, bad_primary_ranks=(2, 4),
             cuda_row_limit=True)
ROPE_APIS = rope_api("rope_rotate_half", False, "rope_rotate_half") + rope_api("rope_interleaved", True,
                                                                                 "rope_interleaved") + [
    Api("qk_norm_rope", QK_NORM, make_qk,
        lambda k, t: k.qk_norm_rope(t["q"], t["k"], t["q_weight"], t["k_weight"], t["cos"], t["sin"], 1e-5),
        qk_ref, **QK_KW),
    Api("qk_norm_rope[out]", QK_NORM + (Arg("q_out", "q_out", "rows", output=True, owner="q"),
                                        Arg("k_out", "k_out", "rows", output=True, owner="k")),
        with_outputs(with_outputs(make_qk, "q_out", like="q"), "k_out", like="k"),
        lambda k, t: k.qk_norm_rope(t["q"], t["k"], t["q_weight"], t["k_weight"], t["cos"], t["sin"], 1e-5,
                                    out=(t["q_out"], t["k_out"])),
        qk_ref, **QK_KW),
]

GATE = Arg("gate", "gate", "rows")
UP = Arg("up", "up", "rows")
ACTIVATION_APIS = [
    Api("gelu", (ROWS_IN,), make_rows("x"), lambda k, t: (k.gelu(t["x"]),),
        lambda t: [(gelu_ref(t["x"], "tanh"), t["x"].dtype)]),
    Api("gelu[out]", (ROWS_IN, OUT), with_outputs(make_rows("x"), "out"),
        lambda k, t: (k.gelu(t["x"], "none", out=t["out"]),), lambda t: [(gelu_ref(t["x"], "none"), t["x"].dtype)]),
    Api("gelu_mul", (GATE, UP), make_rows("gate", "up"), lambda k, t: (k.gelu_mul(t["gate"], t["up"]),),
        lambda t: [(gelu_ref(t["gate"], "tanh") * t["up"].double(), t["gate"].dtype)]),
    Api("gelu_mul[out]", (GATE, UP, Arg("out", "out", "rows", output=True, owner="gate")),
        with_outputs(make_rows("gate", "up"), "out", like="gate"),
        lambda k, t: (k.gelu_mul(t["gate"], t["up"], "none", out=t["out"]),),
        lambda t: [(gelu_ref(t["gate"], "none") * t["up"].double(), t["gate"].dtype)]),
    Api("geglu", (ROWS_IN,), make_geglu, lambda k, t: (k.geglu(t["x"]),),
        lambda t: [(t["x"].double().chunk(2, -1)[0] * gelu_ref(t["x"].chunk(2, -1)[1], "none"), t["x"].dtype)]),
    Api("geglu[out]", (ROWS_IN, Arg("out", "out", "rows", output=True)), make_geglu_out,
        lambda k, t: (k.geglu(t["x"], "tanh", out=t["out"]),),
        lambda t: [(t["x"].double().chunk(2, -1)[0] * gelu_ref(t["x"].chunk(2, -1)[1], "tanh"), t["x"].dtype)]),
]

LAYER_APIS = [
    Api("layers.RMSNorm", (ROWS_IN, replace(WEIGHT, accepts=layer_rms_accepts)),
        with_weight(make_rows("x", scale=3.0)),
        call_layer("RMSNorm", {"weight": "weight", "variance_epsilon": EPS}), layer_rms_ref,
        roundings=2, atol_ulps=4),
    # Like its hosts (Gemma's ``1 + weight.float()``), the layer takes a weight of any dtype.
    Api("layers.RMSNormZeroCentered", (ROWS_IN, replace(WEIGHT, accepts=lambda a, p: True)),
        with_weight(make_rows("x", scale=3.0)),
        call_layer("RMSNormZeroCentered", {"weight": "weight", "eps": EPS}),
        lambda t: [(rms_norm_ref(t["x"], t["weight"].float(), EPS, weight_offset=1.0), t["x"].dtype)]),
    Api("layers.GeluTanh", (ROWS_IN,), make_rows("x"), call_layer("GeluTanh", {}),
        lambda t: [(gelu_ref(t["x"], "tanh"), t["x"].dtype)]),
]



def dequantized(q_and_scales):
    """An FP8 call's (q, scales) as the values they stand for, q * scale in fp32."""
    q, scales = q_and_scales
    return (q.float() * scales,)


def fp8_ref(y):
    """The fp64 result an FP8 row approximates; a row with a NaN or an infinity has a NaN
    (or infinite) amax, so a NaN scale or NaN quotients: every dequantized element NaN."""
    return [(y.masked_fill(~y.isfinite().all(-1, keepdim=True), float("nan")), torch.float32)]


# The FP8 producers, their results dequantized: within half an e4m3 step (3 mantissa bits)
# of the fp64 value; subnormal quotients err by up to amax / 448 * 2^-10 (amax < 45 here).
FP8_KW = dict(takes_float64=False, rtol=2.0 ** -4 + 1e-3, atol=1e-4)
FP8_APIS = [
    Api("quantize_fp8", (ROWS_IN,), make_rows("x"), lambda k, t: dequantized(k.quantize_fp8(t["x"])),
        lambda t: fp8_ref(t["x"].double()), **FP8_KW),
    Api("rms_norm_fp8", (ROWS_IN, WEIGHT), with_weight(make_rows("x", scale=3.0)),
        lambda k, t: dequantized(k.rms_norm_fp8(t["x"], t["weight"], EPS)),
        lambda t: fp8_ref(rms_norm_ref(t["x"], t["weight"], EPS)), **FP8_KW),
    Api("adaln_fp8", (ROWS_IN, Arg("scale", "scale", **MOD), Arg("shift", "shift", **MOD)),
        make_mod(("scale", "shift")),
        lambda k, t: dequantized(k.adaln_fp8(t["x"], t["scale"], t["shift"], EPS, norm="rms")),
        lambda t: fp8_ref(adaln_ref(t["x"], t["scale"], t["shift"], "rms")), bad_primary_ranks=(1, 4), **FP8_KW),
    Api("gated_residual_adaln_fp8",
        (ROWS_IN, Arg("residual", "residual", "rows"), Arg("gate", "gate", **MOD), Arg("scale", "scale", **MOD),
         Arg("shift", "shift", **MOD)),
        make_mod(("residual", "gate", "scale", "shift")),
        lambda k, t: (lambda h, q, s: (h, *dequantized((q, s))))(
            *k.gated_residual_adaln_fp8(t["residual"], t["x"], t["gate"], t["scale"], t["shift"], EPS, norm="rms")),
        lambda t: [gated_adaln_ref(t)[0], *fp8_ref(gated_adaln_ref(t)[1][0])], bad_primary_ranks=(1, 4), **FP8_KW),
    Api("gelu_fp8", (ROWS_IN,), make_rows("x"), lambda k, t: dequantized(k.gelu_fp8(t["x"])),
        lambda t: fp8_ref(gelu_ref(t["x"], "tanh")), **FP8_KW),
    Api("gelu_mul_fp8", (GATE, UP), make_rows("gate", "up"),
        lambda k, t: dequantized(k.gelu_mul_fp8(t["gate"], t["up"], "none")),
        lambda t: fp8_ref(gelu_ref(t["gate"], "none") * t["up"].double()), **FP8_KW),
    Api("geglu_fp8", (ROWS_IN,), make_geglu, lambda k, t: dequantized(k.geglu_fp8(t["x"], "tanh")),
        lambda t: fp8_ref(t["x"].double().chunk(2, -1)[0] * gelu_ref(t["x"].chunk(2, -1)[1], "tanh")), **FP8_KW),
]

APIS = NORM_APIS + ROPE_APIS + ACTIVATION_APIS + LAYER_APIS + FP8_APIS


# ---------------------------------------------------------------------------- perturbations
# Each takes (tensors, target) and returns the expectation; it edits tensors in place.


@dataclass(frozen=True)
class Target:
    backend: str  # the variant: cpu or cuda
    device: str  # where the case's tensors live


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view one element past an aligned allocation."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


def padded(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """The same values with rows `pad` elements apart (an odd row stride)."""
    buf = torch.empty(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype, device=t.device)
    view = buf[..., :t.shape[-1]]
    view.copy_(t)
    return view


def strided_last_dim(t: torch.Tensor) -> torch.Tensor:
    buf = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = buf[..., ::2]
    view.copy_(t)
    return view


def transposed_leading(t: torch.Tensor) -> torch.Tensor:
    """Dims 0 and 1 swapped in memory: leading dims that do not collapse into one row stride."""
    view = torch.empty(t.shape[1], t.shape[0], *t.shape[2:], dtype=t.dtype, device=t.device).transpose(0, 1)
    view.copy_(t)
    return view


def poisoned(t: torch.Tensor) -> torch.Tensor:
    """NaN, +Inf and -Inf at three places (different rows where there are rows)."""
    flat = t.clone().view(-1)
    n = flat.numel()
    for i, v in zip((0, n // 2, n - 1), (float("nan"), float("inf"), float("-inf"))):
        flat[i] = v
    return flat.view(t.shape)


def sharing_rows(out: torch.Tensor, inp: torch.Tensor):
    """(out, inp) views of one buffer with rows 3 elements longer than theirs, out one row
    after inp: they overlap, and neither is dense."""
    d = out.shape[-1]
    buf = torch.zeros(out.numel() // max(d, 1) + 1, d + 3, dtype=out.dtype, device=out.device)
    new_in = buf[:-1, :d].view(inp.shape)
    new_in.copy_(inp)
    return buf[1:, :d].view(out.shape), new_in


def fused_qkv(q: torch.Tensor, k: torch.Tensor):
    """q and k as slices of one fused projection: [B, S, 3, H, D] viewed as [B, H, S, D]
    ([B, S, 3C] as [B, S, C] for 3-D q). Returns (q, k) views holding their values."""
    if q.dim() == 3:
        c = q.shape[-1]
        qkv = torch.empty(*q.shape[:-1], 3 * c, dtype=q.dtype, device=q.device)
        views = qkv[..., :c], qkv[..., c:2 * c]
    else:
        b, h, s, d = q.shape
        qkv = torch.empty(b, s, 3, h, d, dtype=q.dtype, device=q.device)
        views = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    views[0].copy_(q)
    views[1].copy_(k)
    return views


def sharing(out: torch.Tensor, inp: torch.Tensor, shift: int = 1):
    """(out, inp) views of one buffer that partly overlap, both dense."""
    n = max(out.numel() + shift, inp.numel())
    buf = torch.zeros(n, dtype=out.dtype, device=out.device)
    new_in = buf[:inp.numel()].view(inp.shape)
    new_in.copy_(inp.to(out.dtype))
    return buf[shift:shift + out.numel()].view(out.shape), new_in


def other_device(device: str) -> str:
    return "cpu" if device == "cuda" else "cuda"


def mod_view(shape_of: str):
    """scale/shift/gate in another accepted layout: [D], [B, D], [B, 1, D] or a chunk view."""
    def perturb(t, target, key):
        b, s, d = t["x"].shape
        full = t[key]
        if shape_of == "shared":
            t[key] = full[0, 0].clone()
        elif shape_of == "batch":
            t[key] = full[:, 0].clone()
        elif shape_of == "batch_1":
            t[key] = full[:, :1].clone()
        elif shape_of == "chunk":  # emb.chunk(6, -1)[1]: batch stride 6D, no copy
            emb = torch.zeros(b, 6 * d, dtype=full.dtype, device=full.device)
            t[key] = emb.chunk(6, -1)[1]
            t[key].copy_(full[:, 0])
        return REFERENCE
    return perturb


@dataclass(frozen=True)
class Case:
    api: Api
    label: str
    dtype: torch.dtype
    perturb: Callable  # (tensors, target) -> REFERENCE | Refuse
    dims: Dims = field(default_factory=Dims)
    gpu_only: bool = False
    context: Callable = contextlib.nullcontext  # around the perturbation and the call

    def __str__(self):
        return f"{self.api.name}-{self.label}-{SHORT[self.dtype]}"


def turn(api: Api, key: str, salt: int) -> torch.dtype:
    """A dtype per (api, argument, perturbation), spread evenly and stable across runs."""
    return DTYPES[(zlib.crc32(f"{api.name}/{key}".encode()) + salt) % len(DTYPES)]


def arg_cases(api: Api, arg: Arg):
    """Cases that change one argument."""
    p = api.primary
    refuse = Refuse((arg.says,))
    key = arg.key

    def set_to(make_new, expect):
        def perturb(t, target):
            t[key] = make_new(t[key])
            return expect(t, target) if callable(expect) else expect
        return perturb

    # Base dtypes: fp16 and bf16 meet fp32 (and each other), fp32 meets fp16 (the layer's
    # fp32-activation path); value-preserving changes take one dtype each, in turn.
    for dtype, others in ((torch.float16, (torch.float32, torch.bfloat16)), (torch.float32, (torch.float16,)),
                          (torch.bfloat16, (torch.float32,))):
        for other in others:
            if arg is not p:
                # cos and sin must share a dtype: fp32 tables change together (table_cases)
                accepted = arg.accepts(other, dtype) and arg.kind != "table"
                yield Case(api, f"{key}_as_{SHORT[other]}", dtype,
                           set_to(lambda x, o=other: x.to(o), REFERENCE if accepted else refuse))
    if arg.output or arg.kind in ("rows", "heads", "mod"):  # tables share strides: see table_cases
        yield Case(api, f"{key}_row_stride_odd", turn(api, key, 0), set_to(padded, REFERENCE))
    yield Case(api, f"{key}_misaligned", turn(api, key, 1), set_to(misaligned, REFERENCE))
    if not arg.output:
        yield Case(api, f"{key}_nan_inf", turn(api, key, 2), set_to(poisoned, REFERENCE))
    for dtype in (torch.float16, torch.float32):
        yield Case(api, f"{key}_float64", dtype, float64_case(api, arg, dtype, refuse))
    dtype = torch.float16
    int32 = REFERENCE if arg.accepts(torch.int32, dtype) else refuse  # (a layer whose host casts it)
    yield Case(api, f"{key}_int32", dtype, set_to(lambda x: x.to(torch.int32), int32))
    yield Case(api, f"{key}_0dim", dtype, set_to(lambda x: x.flatten()[0].clone(), refuse))
    yield Case(api, f"{key}_last_dim_strided", dtype, set_to(strided_last_dim, refuse))
    yield Case(api, f"{key}_on_other_device", dtype, gpu_only=True, perturb=device_case(arg, p))
    if arg is not p:
        yield Case(api, f"{key}_extra_leading_dim", dtype, set_to(lambda x: x[None], refuse))
        yield Case(api, f"{key}_last_dim_plus_1", dtype,
                   set_to(lambda x: torch.cat([x, x[..., :1]], -1), Refuse((arg.says, "cos", "sin"))
                          if arg.kind == "table" else refuse))
    if arg.kind in ("rows", "heads", "mod") and arg.output is False and arg is not p:
        yield Case(api, f"{key}_leading_size_plus_1", dtype,
                   set_to(lambda x: torch.cat([x, x[:1]], 0), refuse))
    if arg.kind == "rows":
        yield Case(api, f"{key}_leading_dims_uncollapsible", dtype, set_to(transposed_leading, refuse))
    if arg.kind in ("heads", "mod"):  # any strides but the last
        yield Case(api, f"{key}_leading_dims_transposed", dtype, set_to(transposed_leading, REFERENCE))
    if arg.kind == "weight":
        yield Case(api, f"{key}_expanded", dtype, set_to(lambda x: x[:1].expand(x.shape), refuse))
    if arg.kind == "mod":
        for layout in ("shared", "batch", "batch_1", "chunk"):
            yield Case(api, f"{key}_as_{layout}", dtype,
                       lambda t, target, f=mod_view(layout), k=key: f(t, target, k))
    if arg.kind == "heads" and not arg.output and arg is not p:
        def one_head(t, target):
            for name in (key, f"{key}_out"):
                if name in t:
                    t[name] = t[name][:, :1].clone()
            return REFERENCE
        yield Case(api, f"{key}_one_head", dtype, one_head)
        yield Case(api, f"{key}_seq_plus_1", dtype, set_to(lambda x: torch.cat([x, x[:, :, :1]], 2), refuse))
    if arg.output:
        yield from output_cases(api, arg)


def float64_case(api: Api, arg: Arg, dtype: torch.dtype, refuse: Refuse):
    """One tensor made float64. The CPU backend's ops take float64 when all of a call's
    tensors are: an op of one tensor then runs; otherwise the message may name any
    argument whose dtype now differs from the input's. The layers leave float64 to the
    host."""
    def perturb(t, target):
        t[arg.key] = t[arg.key].double()
        if target.device == "cpu" and arg is api.primary and not api.name.startswith("layers."):
            if len(t) == 1 and api.takes_float64:
                return REFERENCE
            return Refuse(tuple(a.says for a in api.args if a.key in t))
        return REFERENCE if arg.accepts(torch.float64, dtype) else refuse
    return perturb


def device_case(arg: Arg, primary: Arg):
    def perturb(t, target):
        t[arg.key] = t[arg.key].to(other_device(target.device))
        if target.backend == "cpu":  # the CPU variant has no CUDA kernels at all
            return Refuse(("CUDA",), NotImplementedError)
        if len(t) == 1:  # the op's only tensor: it simply runs on that device
            return REFERENCE
        return Refuse((arg.says, primary.says))
    return perturb


def output_cases(api: Api, out: Arg):
    dtype = torch.float16
    # Only same-shaped tensors can be aliased: read the shapes off a meta-device build.
    meta = {k: (v.shape, v.dtype) for k, v in api.make(Dims(), dtype, "meta").items()}

    def expanded(t, target):
        x = t[out.key]
        t[out.key] = x[:1].expand(x.shape)
        return Refuse((out.says,))
    yield Case(api, f"{out.key}_expanded", dtype, expanded)

    for inp in api.args:
        if inp.output:
            continue

        def overlap(t, target, inp=inp):
            t[out.key], t[inp.key] = sharing(t[out.key], t[inp.key])
            if inp.kind == "table":  # cos and sin must share strides
                other = "sin" if inp.key == "cos" else "cos"
                t[other] = t[other].clone()
            return Refuse((out.says,))
        yield Case(api, f"{out.key}_partly_overlaps_{inp.key}", dtype, overlap)

        def overlap_by_a_row(t, target, inp=inp):
            t[out.key], t[inp.key] = sharing_rows(t[out.key], t[inp.key])
            if inp.kind == "table":  # cos and sin must share strides: rows 3 elements longer
                other = "sin" if inp.key == "cos" else "cos"
                t[other] = padded(t[other])
            return Refuse((out.says,))
        if meta[inp.key] == meta[out.key]:  # b[1:, :D] against b[:-1, :D]: views that are not dense
            yield Case(api, f"{out.key}_overlaps_{inp.key}_by_a_row", turn(api, out.key + inp.key, 1),
                       overlap_by_a_row)

        def alias(t, target, inp=inp):
            t[out.key] = t[inp.key]
            if inp.key == out.owner or (api.row_local and (out.key, inp.key) not in api.apart):
                return REFERENCE
            return Refuse((out.says, inp.says))
        if meta[inp.key] == meta[out.key]:
            yield Case(api, f"{out.key}_is_{inp.key}", turn(api, out.key + inp.key, 0), alias)

    for other in api.args:
        if other.output and other is not out and meta[other.key][0] == meta[out.key][0]:
            def same_outputs(t, target, other=other):
                t[out.key] = t[other.key]
                return Refuse((out.says, other.says))
            yield Case(api, f"{out.key}_is_{other.key}", dtype, same_outputs)


def table_cases(api: Api):
    """cos and sin change together (they must share sizes, strides and dtype)."""
    if not any(a.kind == "table" for a in api.args):
        return

    def both(f, expect):
        def perturb(t, target):
            t["cos"], t["sin"] = f(t["cos"]), f(t["sin"])
            return expect(t) if callable(expect) else expect
        return perturb

    for salt, (label, f) in enumerate([("shared_over_batch", lambda x: x[0].clone()),
                                       ("batch_1", lambda x: x[:1].clone()), ("misaligned", misaligned),
                                       ("row_stride_odd", padded), ("leading_dims_transposed", transposed_leading)]):
        yield Case(api, f"tables_{label}", turn(api, "tables", salt), both(f, REFERENCE))
    for dtype in (torch.float16, torch.bfloat16):
        yield Case(api, "tables_fp32", dtype, both(lambda x: x.float(), REFERENCE))
    dtype = torch.float16
    cos = Refuse(("cos",))
    yield Case(api, "tables_last_dim_strided", dtype, both(strided_last_dim, cos))
    yield Case(api, "tables_odd_rotary_dim", dtype, both(lambda x: x[..., :-1], cos))
    yield Case(api, "tables_rotary_dim_past_head_dim", dtype, both(lambda x: torch.cat([x] * 8, -1), cos))
    yield Case(api, "tables_4d", dtype, both(lambda x: x[None], cos))
    yield Case(api, "tables_seq_plus_1", dtype, both(lambda x: torch.cat([x, x[:, :1]], 1), cos))
    yield Case(api, "tables_batch_plus_1", dtype, both(lambda x: torch.cat([x, x[:1]], 0), cos))


def call_cases(api: Api):
    """Cases that change the whole call: every dtype, empty inputs, very long rows,
    wrong primary rank."""
    def at_dims(expect=REFERENCE):
        return lambda t, target: expect(target) if callable(expect) else expect

    rope = any(a.kind == "heads" for a in api.args)

    def long_rows(target):
        if api.cuda_row_limit and target.device == "cuda":
            return Refuse(("C",))  # qk_norm_rope keeps a whole row in registers on CUDA
        return REFERENCE

    for dtype in DTYPES:
        yield Case(api, "valid", dtype, at_dims())
        yield Case(api, "empty_batch", dtype, at_dims(), dims=Dims(b=0))
        if rope:
            yield Case(api, "no_heads", dtype, at_dims(), dims=Dims(heads=0))

    long_dims = Dims(b=1, s=2, d=HUGE_D, heads=1, rotary=HUGE_D - 8) if rope else Dims(b=1, s=2, d=HUGE_D)
    yield Case(api, "rows_longer_than_a_block", turn(api, "long", 0), at_dims(long_rows), dims=long_dims)

    def long_misaligned(t, target):
        t[api.primary.key] = misaligned(t[api.primary.key])
        # Unaligned rows of qk_norm_rope fit in registers up to C = 4096 on CUDA.
        if api.cuda_row_limit and target.device == "cuda":
            return Refuse(("C",))
        return REFERENCE
    # 6000: past the 4096 elements the scalar path keeps in registers
    yield Case(api, "rows_longer_than_a_block_misaligned", turn(api, "long", 1), long_misaligned,
               dims=Dims(b=1, s=2, d=6000, heads=1, rotary=5992) if rope or api.cuda_row_limit
               else Dims(b=1, s=2, d=HUGE_D))
    yield Case(api, "empty_seq", turn(api, "", 0), at_dims(), dims=Dims(s=0))
    yield Case(api, "empty_last_dim", turn(api, "", 1), at_dims(), dims=Dims(d=0, rotary=0))
    for rank in api.bad_primary_ranks:
        def wrong_rank(t, target, rank=rank):
            x = t[api.primary.key]
            t[api.primary.key] = torch.randn((2,) * (rank - 1) + (x.shape[-1],)).to(x)
            return Refuse((api.primary.says,))
        yield Case(api, f"{api.primary.key}_{rank}d", torch.float16, wrong_rank)


# ---------------------------------------------------------------------------- autograd misuse


def op_name(api: Api) -> str:
    """The registered op behind a functional form, as its messages name it."""
    base = api.name.split("[")[0]
    base = "rope" if base.startswith("rope_") else base
    if api.name.endswith("[out]"):
        return f"{base}_out"
    return f"{base}_" if api.name.endswith("[inplace]") else base


def written_args(api: Api):
    """The tensors a call writes: its outputs, or q and k in place."""
    if api.name.endswith("[inplace]"):
        return [a for a in api.args if a.key in ("q", "k")]
    return [a for a in api.args if a.output]


# The backward op whose outputs a double backward reaches (qk_norm_rope: either of its two).
BACKWARD_OPS = {"rms_norm": ("rms_norm_backward",), "fused_add_rms_norm": ("rms_norm_backward",),
                "adaln": ("adaln_backward",), "gated_residual": ("gated_residual_backward",),
                "gated_residual_adaln": ("gated_residual_adaln_backward",), "rope": ("rope_backward",),
                "qk_norm_rope": ("rope_backward", "rms_norm_backward"), "gelu": ("gelu_backward",),
                "gelu_mul": ("gelu_mul_backward",), "geglu": ("geglu_backward",),
                # no derivative: the call itself refuses an input that requires grad
                "quantize_fp8": ("quantize_fp8",), "rms_norm_fp8": ("rms_norm_fp8",), "adaln_fp8": ("adaln_fp8",),
                "gated_residual_adaln_fp8": ("gated_residual_adaln_fp8",), "gelu_fp8": ("gelu_fp8",),
                "gelu_mul_fp8": ("gelu_mul_fp8",), "geglu_fp8": ("geglu_fp8",)}


def double_backward(call):
    """The call, a backward with create_graph=True, then the backward of those grads."""
    def run(kernel, t):
        inputs = [v for v in t.values() if v.requires_grad]
        loss = sum(o.float().square().sum() for o in call(kernel, t))
        grads = torch.autograd.grad(loss, inputs, create_graph=True)
        torch.autograd.grad(sum(g.float().sum() for g in grads), inputs)
    return run


def backward_after(call):
    """The call under torch.no_grad() (an in-place update), then the backward of the
    tensor saved before it (t["_saved"])."""
    def run(kernel, t):
        with torch.no_grad():
            call(kernel, t)
        t["_saved"].sum().backward()
    return run


def autograd_cases(api: Api):
    """Forward-mode AD; double backward (functional forms); for the forms that write: written
    tensors that require grad, are inference tensors or were saved for a backward, and
    their version counters."""
    if api.name.startswith("layers."):  # the layers hand what they do not take to the host
        return
    dtype = torch.float32
    op = op_name(api)

    def dual(t, target):
        x = t[api.primary.key]
        t[api.primary.key] = fwAD.make_dual(x, torch.randn_like(x))
        return Refuse((op,), NotImplementedError)
    yield Case(api, "forward_ad_dual_input", dtype, dual, context=fwAD.dual_level)

    written = written_args(api)
    if not written:
        def needs_grad(t, target):
            for a in api.args:
                if a.kind != "table":
                    t[a.key] = t[a.key].detach().requires_grad_()
            return Refuse(BACKWARD_OPS[op])
        yield Case(replace(api, call=double_backward(api.call)), "double_backward", dtype, needs_grad)
        return

    for arg in written:
        def requires_grad(t, target, arg=arg):
            t[arg.key] = t[arg.key].detach().clone().requires_grad_()
            return Refuse((arg.says,))
        yield Case(api, f"{arg.key}_requires_grad", dtype, requires_grad)

        def inference_tensor(t, target, arg=arg):
            with torch.inference_mode():
                t[arg.key] = t[arg.key].clone()
            return Refuse((arg.says,))
        yield Case(api, f"{arg.key}_inference_tensor", dtype, inference_tensor)

        def saved_for_backward(t, target, arg=arg):
            leaf = t[arg.key].detach().clone().requires_grad_()
            t[arg.key] = leaf * 1  # a non-leaf that sin() saves for its backward
            t["_saved"] = t[arg.key].sin()
            return Refuse(("modified by an inplace operation",))
        yield Case(replace(api, call=backward_after(api.call)), f"{arg.key}_saved_for_backward", dtype,
                   saved_for_backward)

    keys = tuple(a.key for a in written)
    yield Case(api, "written_versions_bumped", dtype, lambda t, target: Bumped(keys))
    yield Case(api, "written_versions_bumped_in_inference_mode", dtype, lambda t, target: Bumped(keys),
               context=torch.inference_mode)
    if api.name.startswith(("rope_", "qk_norm_rope")) and api.name.endswith("[out]"):
        def swapped(t, target):
            t["q"], t["k"] = fused_qkv(t["q"], t["k"])
            qkv = t["q"]._base
            # fresh views of k's and q's slices: the same elements, other tensor objects
            t["q_out"], t["k_out"] = (qkv.as_strided(v.shape, v.stride(), v.storage_offset())
                                      for v in (t["k"], t["q"]))
            return Refuse(("q_out", "k_out"))
        yield Case(api, "outputs_swapped_over_fused_qkv", dtype, swapped)


def python_level_cases():
    """Arguments checked in Python before any op runs: ValueError (TypeError for a bool
    given for a number) naming them."""
    by_name = {api.name: api for api in NORM_APIS + ROPE_APIS}
    value_error = Refuse(("norm",), ValueError)
    together = Refuse(("out", "residual_out"), ValueError)
    for name in ("adaln", "gated_residual_adaln"):
        yield Case(replace(by_name[name], name=f"{name}[norm=group]", call=norm_group_call(name)), "norm",
                   torch.float16, lambda t, target: value_error)
    fused = by_name["fused_add_rms_norm[out]"]
    yield Case(replace(fused, call=lambda k, t: k.fused_add_rms_norm(t["x"], t["residual"], t["weight"],
                                                                      out=t["out"])),
               "out_without_residual_out", torch.float16, lambda t, target: together)
    gated = by_name["gated_residual_adaln[out]"]
    yield Case(replace(gated, call=lambda k, t: k.gated_residual_adaln(t["residual"], t["x"], t["gate"], t["scale"],
                                                                        t["shift"], residual_out=t["residual_out"])),
               "residual_out_without_out", torch.float16, lambda t, target: together)

    def bool_for(name, call):
        api = by_name[name]
        return Case(replace(api, name=f"{name}[bool]", call=call), "bool_for_a_number", torch.float16,
                    lambda t, target: Refuse(("eps", "weight_offset", "sequence_dim"), TypeError))
    yield bool_for("rms_norm", lambda k, t: k.rms_norm(t["x"], t["weight"], True))
    yield bool_for("rms_norm[out]", lambda k, t: k.rms_norm(t["x"], t["weight"], weight_offset=True, out=t["out"]))
    yield bool_for("fused_add_rms_norm", lambda k, t: k.fused_add_rms_norm(t["x"], t["residual"], t["weight"], True))
    yield bool_for("adaln", lambda k, t: k.adaln(t["x"], t["scale"], t["shift"], True))
    yield bool_for("gated_residual_adaln",
                   lambda k, t: k.gated_residual_adaln(t["residual"], t["x"], t["gate"], t["scale"], t["shift"], True))
    yield bool_for("qk_norm_rope",
                   lambda k, t: k.qk_norm_rope(t["q"], t["k"], t["q_weight"], t["k_weight"], t["cos"], t["sin"], True))
    yield bool_for("rope_rotate_half",
                   lambda k, t: k.rope_rotate_half(t["q"], t["k"], t["cos"], t["sin"], sequence_dim=True))

    # [B, S, C] has one sequence dim, 1: another is refused, not ignored
    for name in ("rope_interleaved", "rope_rotate_half[inplace]", "rope_interleaved[out]"):
        api = by_name[name]
        fn = name.split("[")[0]
        keywords = ({"inplace": True} if name.endswith("[inplace]")
                    else {"out": "q_out"} if name.endswith("[out]") else {})

        def call(k, t, fn=fn, keywords=keywords):
            kw = {key: (t["q_out"], t["k_out"]) if value == "q_out" else value for key, value in keywords.items()}
            return getattr(k, fn)(t["q"], t["k"], t["cos"], t["sin"], sequence_dim=2, **kw)

        def three_d(t, target):
            for key in ("q", "k", "q_out", "k_out"):
                if key in t:
                    t[key] = t[key][:, 0]  # [B, S, D]: one head as the channels
            return Refuse(("sequence_dim",))
        yield Case(replace(api, name=f"{name}[3d]", call=call), "sequence_dim_2_for_3d_q", torch.float16, three_d)


def norm_group_call(name):
    if name == "adaln":
        return lambda k, t: k.adaln(t["x"], t["scale"], t["shift"], norm="group")
    return lambda k, t: k.gated_residual_adaln(t["residual"], t["x"], t["gate"], t["scale"], t["shift"], norm="group")


def all_cases():
    for api in APIS:
        for arg in api.args:
            yield from arg_cases(api, arg)
        yield from table_cases(api)
        yield from call_cases(api)
        yield from autograd_cases(api)
    yield from python_level_cases()


CASES = list(all_cases())


# ---------------------------------------------------------------------------- the test

_ran = {"refused": 0, "reference": 0}


@pytest.fixture(scope="module", autouse=True)
def _report_case_count(request):
    yield
    total = sum(_ran.values())
    if total:
        line = (f"bad-input matrix: {total} cases ran ({_ran['refused']} refused with the argument named, "
                f"{_ran['reference']} matched the fp64 reference); {len(CASES)} per target")
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():  # past pytest's output capture
            print(f"\n{line}")


def check_outputs(api: Api, outputs, expected, dtype):
    assert len(outputs) == len(expected)
    rtol = max(TOLERANCE[dtype]["rtol"] * api.roundings, api.rtol)
    atol = max(1e-5, api.atol_ulps * TOLERANCE[dtype]["rtol"], api.atol)
    for actual, (want, want_dtype) in zip(outputs, expected):
        assert actual.dtype == want_dtype, f"dtype {actual.dtype}, expected {want_dtype}"
        assert actual.shape == want.shape, f"shape {tuple(actual.shape)}, expected {tuple(want.shape)}"
        torch.testing.assert_close(actual.double().cpu(), want.cpu(), rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input(target, case):
    kernel, device = target
    if case.gpu_only and not HAS_GPU:
        pytest.skip("needs a second device (GPU)")
    backend = "cuda" if "_cuda_" in kernel.ops.name else "cpu"
    tensors = case.api.make(case.dims, case.dtype, device)
    with case.context():
        run_case(kernel, case, tensors, Target(backend, device))


def run_case(kernel, case, tensors, target):
    expect = case.perturb(tensors, target)
    if isinstance(expect, Refuse):
        with pytest.raises((RuntimeError, ValueError, TypeError)) as info:
            case.api.call(kernel, tensors)
        assert isinstance(info.value, expect.error), f"{type(info.value).__name__}: {info.value}"
        names = "|".join(re.escape(n) for n in expect.names)
        assert re.search(rf"(?<![\w.])({names})(?!\w)", str(info.value)), \
            f"message does not name {expect.names}: {info.value}"
        _ran["refused"] += 1
        return
    # Outputs may alias inputs: the reference reads a snapshot taken before the call.
    snapshot = {k: v.clone() for k, v in tensors.items()}
    expected = case.api.ref(snapshot)
    versions = {k: tensors[k]._version for k in expect.keys} if isinstance(expect, Bumped) else {}
    outputs = case.api.call(kernel, tensors)
    check_outputs(case.api, outputs, expected, tensors[case.api.primary.key].dtype)
    for k, before in versions.items():
        assert tensors[k]._version > before, f"{k} was written but its version stayed {before}"
    _ran["reference"] += 1


def test_the_matrix_covers_every_public_function_and_layer(kernel):
    # the op functions: not the submodules, nor the integration and the FP8 linears (which
    # take models and modules, not tensors: test_fp8_linear.py)
    functions = {n for n in kernel.__all__
                 if n not in ("layers", "ops", "reference", *kernel.integration.__all__, *kernel.fp8_linear.__all__)}
    tried = {api.name.split("[")[0] for api in APIS}
    assert functions <= tried, functions - tried
    # The row layers of transformers' hooks; the model-level layers (diffusers blocks,
    # attention, the rotary hook) are checked against their hosts in test_integration_*.
    layers = {"RMSNorm", "RMSNormZeroCentered", "GeluTanh"}
    assert {f"layers.{n}" for n in layers} <= tried
    assert len(CASES) >= 500


# ---------------------------------------------------------------------------- every registered op
# The raw ops are public (kernel.ops): the backward ops, the forwards with row statistics and
# the out= / in-place ops validate as the functional forms do. Each is walked from the
# build's namespace (a new op without a sample fails test_every_registered_op_has_a_sample)
# with one tensor argument at a time made wrong. A call must raise a clean error or give
# what the same call gives in float64 (the CPU ops compute float64 in double): never a
# crash, never a silent wrong result.

CLEAN_ERRORS = (RuntimeError, TypeError, ValueError)
# The functional ops with a backward (their grads: test_autograd.py, test_gradcheck.py);
# every other op that writes no tensor has no derivative.
DIFFERENTIABLE_OPS = {"rms_norm", "fused_add_rms_norm", "adaln", "gated_residual", "gated_residual_adaln", "rope",
                      "qk_norm_rope", "gelu", "gelu_mul", "geglu"}


def registered_ops(kernel):
    """name -> OpOverload of every op in the build's namespace."""
    prefix = kernel.ops.name + "::"
    names = sorted(n[len(prefix):] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix))
    return {n: getattr(kernel.ops, n).default for n in names}


def op_samples(kernel, device):
    """name -> a valid call's arguments: bf16 tensors (fp32 tables), so that the fp32
    weights, tables, outputs and grads that 16-bit inputs may take are among the changes."""
    dt = torch.bfloat16
    b, s, d, h = 2, 3, 16, 2

    def r(*shape, scale=1.0, dtype=dt):
        return (torch.randn(*shape) * scale).to(device=device, dtype=dtype)

    x, res, g, g2 = r(b, s, d, scale=2.0), r(b, s, d), r(b, s, d), r(b, s, d)
    w, gate, scale, shift = r(d), r(b, 1, d, scale=0.3), r(b, 1, d, scale=0.3), r(b, 1, d, scale=0.3)
    q, k = r(b, h, s, d), r(b, 1, s, d)  # GQA
    cos, sin = rope_tables(b, s, 12, torch.float32, device, interleaved=False)
    lcos, lsin = rope_tables(b, s, d, torch.float32, device, interleaved=True)
    stats = kernel.ops.adaln_with_stats(x, scale, shift, EPS, "layer")[1]
    summed, _, summed_stats = kernel.ops.gated_residual_adaln_with_stats(res, x, gate, scale, shift, EPS, "rms")
    e, wide = torch.empty_like, r(b, s, 2 * d)
    return {
        "rms_norm": [x, w, EPS, 0.0, False, None],
        "rms_norm_out": [e(x), x, w, EPS, 1.0, False],
        "fused_add_rms_norm": [x, res, w, EPS, 0.0, True],
        "fused_add_rms_norm_out": [e(x), e(x), x, res, w, EPS, 0.0, False],
        "adaln": [x, scale, shift, EPS, "layer"],
        "adaln_out": [e(x), x, scale, shift, EPS, "rms"],
        "adaln_with_stats": [x, scale, shift, EPS, "layer"],
        "gated_residual": [res, x, gate],
        "gated_residual_out": [e(x), res, x, gate],
        "gated_residual_adaln": [res, x, gate, scale, shift, EPS, "rms"],
        "gated_residual_adaln_out": [e(x), e(x), res, x, gate, scale, shift, EPS, "layer"],
        "gated_residual_adaln_with_stats": [res, x, gate, scale, shift, EPS, "layer"],
        "rms_norm_backward": [g, x, w, EPS, 0.0, False, g2],
        "adaln_backward": [g, x, scale, shift, EPS, "layer", g2, stats],
        "gated_residual_backward": [g, x, gate],
        "gated_residual_adaln_backward": [g, g2, summed, x, gate, scale, shift, EPS, "rms", summed_stats],
        "rope": [q, k, cos, sin, False, 2],
        "rope_out": [e(q), e(k), q, k, cos, sin, False, 2],
        "rope_": [q.clone(), k.clone(), cos, sin, False, 2],
        "rope_backward": [q, k, cos, sin, False, 2],
        "qk_norm_rope": [x, res, w, r(d), lcos, lsin, 1e-5],
        "qk_norm_rope_out": [e(x), e(x), x, res, w, r(d), lcos, lsin, 1e-5],
        "gelu": [x, "tanh"],
        "gelu_out": [e(x), x, "none"],
        "gelu_mul": [x, res, "tanh"],
        "gelu_mul_out": [e(x), x, res, "tanh"],
        "geglu": [wide, "none"],
        "geglu_out": [e(x), wide, "tanh"],
        "gelu_backward": [g, x, "none"],
        "gelu_mul_backward": [g, x, res, "tanh"],
        "geglu_backward": [g, wide, "tanh"],
        "quantize_fp8": [x],
        "quantize_fp8_static": [x, torch.tensor([0.05], device=device)],
        "rms_norm_fp8": [x, w, EPS, 0.0, True],
        "rms_norm_fp8_static": [x, w.float(), EPS, 1.0, False, torch.tensor([0.05], device=device)],
        "adaln_fp8": [x, scale, shift, EPS, "layer"],
        "adaln_fp8_static": [x, scale, shift, EPS, "rms", torch.tensor([0.05], device=device)],
        "gated_residual_adaln_fp8": [res, x, gate, scale, shift, EPS, "layer"],
        "gated_residual_adaln_fp8_static": [res, x, gate, scale, shift, EPS, "rms", torch.tensor([0.05], device=device)],
        "gelu_fp8": [x, "tanh"],
        "gelu_fp8_static": [x, "none", torch.tensor([0.05], device=device)],
        "gelu_mul_fp8": [x, res, "none"],
        "gelu_mul_fp8_static": [x, res, "tanh", torch.tensor([0.05], device=device)],
        "geglu_fp8": [wide, "tanh"],
        "geglu_fp8_static": [wide, "none", torch.tensor([0.05], device=device)],
    }


def tensor_args(op):
    """(index, name, written) of each Tensor / Tensor? argument of the op's schema."""
    for i, a in enumerate(op._schema.arguments):
        if "Tensor" in str(a.type):
            yield i, a.name, a.alias_info is not None and a.alias_info.is_write


def results(op, args):
    """What a call gives: its returned tensors and the tensors it writes."""
    returned = op(*args)
    returned = [] if returned is None else list(returned) if isinstance(returned, (tuple, list)) else [returned]
    return returned + [args[i] for i, _, written in tensor_args(op) if written]


# The ops without a float64 form (FP8 has no float64 meaning): their reference is the call
# in float32 on the CPU, whose math they share.
FP32_REFERENCE_OPS = {"quantize_fp8", "quantize_fp8_static", "rms_norm_fp8", "rms_norm_fp8_static", "adaln_fp8",
                      "adaln_fp8_static", "gated_residual_adaln_fp8", "gated_residual_adaln_fp8_static", "gelu_fp8",
                      "gelu_fp8_static", "gelu_mul_fp8", "gelu_mul_fp8_static", "geglu_fp8", "geglu_fp8_static"}


def in_float64(op, args):
    """The call with every tensor in float64 on the CPU, the one device that takes float64
    (row statistics stay fp32, as the ops take them; an output dtype follows the input), or
    in float32 for the FP32_REFERENCE_OPS."""
    names = [a.name for a in op._schema.arguments]
    wide = torch.float32 if op._schema.name.split("::")[-1] in FP32_REFERENCE_OPS else torch.float64
    converted = []
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            a = a.detach().cpu() if name == "stats" else a.detach().cpu().to(wide)
        elif isinstance(a, torch.dtype):
            a = None
        converted.append(a)
    return converted


def refuses_or_matches(op, args):
    """None when the call refuses cleanly or matches its float64 run; else what went wrong."""
    values = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # before any write
    try:
        ours = results(op, args)
    except CLEAN_ERRORS:
        return None
    try:
        expected = results(op, in_float64(op, values))
    except CLEAN_ERRORS as e:
        return f"accepted, but its float64 run refuses: {e}"
    low = any(isinstance(a, torch.Tensor) and a.dtype in (torch.float16, torch.bfloat16) for a in args)
    tol = 5e-2 if low else 1e-4
    for i, (got, want) in enumerate(zip(ours, expected)):
        got, want = got.cpu(), want.double()
        if got.shape != want.shape:
            return f"result {i} has shape {tuple(got.shape)}, float64 {tuple(want.shape)}"
        scale = want.abs().nan_to_num(0.0, 0.0, 0.0).max().item() if want.numel() else 0.0
        if not torch.isclose(got.double(), want, rtol=tol, atol=tol * max(scale, 1.0), equal_nan=True).all():
            return f"result {i} differs from the float64 run: max error {(got.double() - want).abs().max().item():.3g}"
    return None


def each_tensor_argument(kernel, device):
    """(op name, op, a valid call's args, index, argument name, written) for every tensor
    argument of every registered op."""
    samples = op_samples(kernel, device)
    for name, op in registered_ops(kernel).items():
        for index, arg, written in tensor_args(op):
            if samples[name][index] is not None:
                yield name, op, samples[name], index, arg, written


def walk(kernel, device, change):
    """Applies change(op, args, index, name, written) -> [(label, args)] to every tensor
    argument of every registered op; returns the calls that neither refused nor matched."""
    failures = []
    for name, op, sample, index, arg, written in each_tensor_argument(kernel, device):
        for label, args in change(op, sample, index, arg, written):
            problem = refuses_or_matches(op, args)
            if problem:
                failures.append(f"{name}({arg} {label}): {problem}")
    return failures


def replaced(args, index, value, *more):
    """Fresh copies of args with args[index] = value (and more (index, value) pairs), as given."""
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    for i, v in ((index, value), *zip(more[::2], more[1::2])):
        args[i] = v
    return args


def test_every_registered_op_has_a_sample(kernel):
    registered = set(registered_ops(kernel))
    assert len(registered) >= 30, registered
    assert registered == set(op_samples(kernel, "cpu")), registered ^ set(op_samples(kernel, "cpu"))
    assert registered >= DIFFERENTIABLE_OPS


def test_every_registered_op_refuses_or_computes_other_dtypes(kernel, device):
    def other_dtypes(op, args, index, name, written):
        t = args[index]
        for dtype in (torch.int32, torch.float64, torch.float16, torch.float32, torch.bfloat16):
            if dtype != t.dtype:
                yield f"as {dtype}", replaced(args, index, t.to(dtype))
    assert walk(kernel, device, other_dtypes) == []


def test_every_registered_op_refuses_or_computes_other_shapes(kernel, device):
    def other_shapes(op, args, index, name, written):
        t = args[index]
        yield "with a column more", replaced(args, index, torch.cat([t, t[..., :1]], -1))
        yield "with a row more", replaced(args, index, torch.cat([t, t[:1]], 0))
        yield "with a leading dim more", replaced(args, index, t[None].clone())
        yield "as its first element", replaced(args, index, t.flatten()[:1].clone())
    assert walk(kernel, device, other_shapes) == []


def test_every_registered_op_refuses_or_computes_overlapping_writes(kernel, device):
    """A written tensor sharing memory with another argument of the call, dense (shifted by
    one element) or not (shifted by a padded row)."""
    def overlapping(op, args, index, name, written):
        if not written:
            return
        for other, other_name, _ in tensor_args(op):
            t = args[other]
            if other == index or t is None or t.dtype != args[index].dtype:
                continue
            out, inp = sharing(args[index], t)
            yield f"overlapping {other_name}", replaced(args, index, out, other, inp)
            if t.shape == args[index].shape:
                out, inp = sharing_rows(args[index], t)
                yield f"a row after {other_name}", replaced(args, index, out, other, inp)
    assert walk(kernel, device, overlapping) == []


def unrefused(kernel, device, call, error, pattern):
    """call(op, args, index) with each tensor argument of each registered op in turn must
    raise `error` whose message matches pattern(op name, argument name); returns the calls
    that did not."""
    failures = []
    for name, op, sample, index, arg, _ in each_tensor_argument(kernel, device):
        try:
            call(op, sample, index)
            failures.append(f"{name} ({arg}): accepted")
        except error as e:
            if not re.search(pattern(name, arg), str(e)):
                failures.append(f"{name} ({arg}): {e}")
    return failures


def test_every_registered_op_refuses_other_devices(kernel, device):
    """A meta tensor in a call of the CPU kernels (called directly: a meta tensor in a call
    sends it to the fake implementations instead): refused, naming the argument."""
    if device != "cpu":
        pytest.skip("the CPU kernels")
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

    def on_meta(op, args, index):
        op.redispatch(cpu, *replaced(args, index, args[index].to("meta")))
    assert unrefused(kernel, device, on_meta, RuntimeError,
                     lambda name, arg: rf"\b{arg}\b.*\bmeta\b|\bmeta\b.*\b{arg}\b") == []


def test_every_registered_op_refuses_forward_mode_ad(kernel, device):
    def dual(op, args, index):
        with fwAD.dual_level():
            op(*replaced(args, index, fwAD.make_dual(args[index].clone(), torch.randn_like(args[index]))))
    assert unrefused(kernel, device, dual, NotImplementedError, lambda name, arg: rf"\b{name}: forward-mode AD") == []


def test_every_registered_op_that_writes_bumps_versions_and_refuses_autograd(kernel, device):
    """Each written tensor's version goes up (in inference mode too); a call refuses while
    grad mode is on and any of its tensors requires grad (a leaf written in place
    included), and refuses to write an inference tensor outside inference mode."""
    samples = op_samples(kernel, device)
    failures = []
    writing = {n: op for n, op in registered_ops(kernel).items() if any(w for *_, w in tensor_args(op))}
    assert len(writing) == 11, sorted(writing)
    for name, op in writing.items():
        args = samples[name]
        written = [(i, a) for i, a, w in tensor_args(op) if w]
        for mode in (contextlib.nullcontext, torch.no_grad, torch.inference_mode):
            fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            before = [fresh[i]._version for i, _ in written]
            with mode():
                op(*fresh)
            after = [fresh[i]._version for i, _ in written]
            if any(v <= u for u, v in zip(before, after)):
                failures.append(f"{name} under {mode.__name__}: written versions {before} -> {after}")
        for index, arg, is_written in tensor_args(op):
            t = args[index]
            if t is None or not t.is_floating_point():
                continue
            with_grad = replaced(args, index, t.clone().requires_grad_())
            with pytest.raises(RuntimeError, match=rf"{name}: .*{arg} requires grad"):
                op(*with_grad)
            with torch.no_grad():  # an optimizer-style update (of a leaf, when written) runs
                op(*with_grad)
            if is_written:
                with torch.inference_mode():
                    inference = t.clone()
                with pytest.raises(RuntimeError, match=rf"{name}: {arg} is an inference tensor"):
                    op(*replaced(args, index, inference))
    assert failures == []


def test_every_registered_op_without_a_backward_refuses_double_backward(kernel, device):
    """Called on tensors that require grad (as a backward with create_graph=True calls the
    backward ops), an op without a derivative gives outputs whose backward raises, naming it."""
    samples = op_samples(kernel, device)
    for name, op in registered_ops(kernel).items():
        if name in DIFFERENTIABLE_OPS or any(w for *_, w in tensor_args(op)):
            continue
        args = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in samples[name]]
        if name in FP32_REFERENCE_OPS:  # FP8 outputs: the call itself refuses (test_fp8.py)
            first = op._schema.arguments[0].name  # the first argument that requires grad, named
            with pytest.raises(RuntimeError, match=rf"^{name}: {first} requires grad, but FP8 outputs are not "
                               "differentiable"):
                op(*args)
            continue
        outputs = results(op, args)
        assert all(o.grad_fn is not None for o in outputs), name
        loss = sum(o.float().sum() for o in outputs)
        with pytest.raises(RuntimeError, match=rf"\b{name}\b.*(double backward is not supported|not differentiable)"):
            torch.autograd.grad(loss, [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad])
        with torch.no_grad():
            assert all(o.grad_fn is None for o in results(op, samples[name])), name
