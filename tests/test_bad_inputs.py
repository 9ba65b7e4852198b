"""Bad input, generated from a table: every public function, its out-variant and the
layers, with one tensor argument at a time given the wrong device, dtype, rank, shape,
strides, alignment, or memory shared with an input, plus whole-call variations (empty,
rows longer than a CUDA block holds, NaN/Inf).

Each case expects one of two outcomes and nothing else: a RuntimeError (or ValueError)
whose message names the argument, or the fp64 reference's result (NaN and Inf where the
reference has them). Cases run on every target of conftest.py; GPU-only cases (devices)
skip without a GPU. The module prints how many cases ran at the end."""

import re
import zlib
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Callable, Optional

import pytest
import torch
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

    @property
    def primary(self) -> Arg:
        return self.args[0]


@dataclass(frozen=True)
class Refuse:
    names: tuple  # the message must name one of these
    error: type = RuntimeError


REFERENCE = "reference"


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
    """transformers' Llama order: fp16/bf16 activations with a weight of their dtype or
    fp32 (fp32 out); fp32 activations with an fp32, fp16 or bf16 weight (fp32 math)."""
    return a == p or a == torch.float32 or (p == torch.float32 and a in (torch.float16, torch.bfloat16))


class _HostRefused(RuntimeError, ValueError):
    """Raised by the stand-in host: an instance of either error type a refusal may expect."""


class _Host(SimpleNamespace):
    """Stands for the host module. The layers hand what they do not support to the host's
    own forward (`layers._host(self).forward`); this one refuses, naming the input, so such a case
    shows up as a refusal rather than as the host's (untested here) result."""

    def forward(self, x):
        if x.numel() == 0 and x.is_floating_point():  # what any row-wise host returns for no rows
            return torch.empty_like(x)
        raise _HostRefused(f"host forward: input of dtype {x.dtype} and sizes {tuple(x.shape)} left to the host")


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

APIS = NORM_APIS + ROPE_APIS + ACTIVATION_APIS + LAYER_APIS


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
            if len(t) == 1:
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
    for rank in api.bad_primary_ranks:
        def wrong_rank(t, target, rank=rank):
            x = t[api.primary.key]
            t[api.primary.key] = torch.randn((2,) * (rank - 1) + (x.shape[-1],)).to(x)
            return Refuse((api.primary.says,))
        yield Case(api, f"{api.primary.key}_{rank}d", torch.float16, wrong_rank)


def python_level_cases():
    """Arguments checked in Python before any op runs: ValueError naming them."""
    by_name = {api.name: api for api in NORM_APIS}
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
    rtol = TOLERANCE[dtype]["rtol"] * api.roundings
    atol = max(1e-5, api.atol_ulps * TOLERANCE[dtype]["rtol"])
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
    expect = case.perturb(tensors, Target(backend, device))
    if isinstance(expect, Refuse):
        with pytest.raises((RuntimeError, ValueError)) as info:
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
    outputs = case.api.call(kernel, tensors)
    check_outputs(case.api, outputs, expected, tensors[case.api.primary.key].dtype)
    _ran["reference"] += 1


def test_the_matrix_covers_every_public_function_and_layer(kernel):
    # the op functions: not the submodules, nor the integration (which takes models, not tensors)
    functions = {n for n in kernel.__all__ if n not in ("layers", "ops", "reference", *kernel.integration.__all__)}
    tried = {api.name.split("[")[0] for api in APIS}
    assert functions <= tried, functions - tried
    # The row layers of transformers' hooks; the model-level layers (diffusers blocks,
    # attention, the rotary hook) are checked against their hosts in test_integration_*.
    layers = {"RMSNorm", "RMSNormZeroCentered", "GeluTanh"}
    assert {f"layers.{n}" for n in layers} <= tried
    assert len(CASES) >= 500
