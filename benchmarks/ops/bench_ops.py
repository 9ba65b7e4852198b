"""Every op against its peers on the model shapes it serves: our kernel ("ltx"), the
PyTorch eager code the host library runs ("eager", also the reference), torch.compile of
that code (dynamic=False), F.rms_norm where it applies, Liger-Kernel and quack where they
have the op (each skipped, with the reason, when it is not importable or fails).

    python -m benchmarks.ops.bench_ops              # everything: table, JSON, PNG, Markdown
    python -m benchmarks.ops.bench_ops --quick      # a representative subset (< 2 min, H200)
    python -m benchmarks.ops.bench_ops --ops rms_norm,geglu --json r.json --plot r.png
    python -m benchmarks.ops.bench_ops --backward   # adds forward+backward rows (large shapes)
    python -m benchmarks.ops.bench_ops --smoke      # tiny shapes on the CPU: proves it runs

Columns: kernel time (CUDA-graph replay, cold L2, median), eager call time (Python calls
back to back over the same rotated inputs, median), the bytes an op must move, GB/s and %
of the copy bandwidth measured in the same run (from kernel time), the time of a copy of
the same bytes (same protocol) as a share of the row's kernel time, ltx's time over the
fastest peer's (kernel and eager), and the max abs error
against an fp64 evaluation of the eager code. An implementation whose error is over 16x
every other's is skipped as wrong, not timed; if it is ltx, the run exits non-zero once
its report is written. With no output flag (and not --smoke) the JSON, PNG and Markdown go
to benchmarks/results/bench_ops[_backward].* (the latest run of each kind is kept there).
"""

import argparse
import datetime
import importlib
import importlib.util
import json
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from benchmarks import harness

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
PEER_LIBRARIES = {"liger": "liger_kernel.ops", "quack": "quack", "quack.rotary": "quack.rotary"}


# --- shapes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    """The shapes of a run, per op family. ``quick`` names (family, shape) pairs that
    --quick keeps (bf16); ``backward`` those that --backward times forward+backward."""

    rms_norm: Sequence[Tuple[int, int]]  # (rows, D), weighted; bf16, fp16 and fp32
    rms_norm_no_weight: Sequence[Tuple[int, int]]  # LTX's norm1/norm2; bf16, fp16, fp32
    fused_add_rms_norm: Sequence[Tuple[int, int]]  # (rows, D): a decoder layer's add + norm
    adaln: Sequence[Tuple[int, int, int, bool]]  # (B, S, D, per-token scale/shift)
    gated_residual_adaln: Sequence[Tuple[int, int, int]]  # (B, S, D), [B,1,D] gate/scale/shift
    gated_residual: Sequence[Tuple[int, int, int]]  # (B, S, D), [B,1,D] gate
    rope_rotate_half: Sequence[Tuple[int, int, int, int, int]]  # (B, Hq, Hkv, S, D)
    rope_ltx: Sequence[Tuple[int, int, int]]  # (B, S, C): rope_interleaved and qk_norm_rope
    geglu: Sequence[Tuple[int, int]]  # (rows, H): input [rows, 2H]
    gelu_tanh: Sequence[Tuple[int, ...]]
    gelu_mul: Sequence[Tuple[int, int]]
    quick: frozenset = frozenset()
    backward: frozenset = frozenset()


MODEL_SHAPES = Shapes(
    rms_norm=[(1024, 2048), (128, 4096), (4096, 4096), (8192, 4096), (32768, 4096), (32768, 8192),
              (648720, 128), (8192, 1536), (8192, 65536)],
    rms_norm_no_weight=[(5376, 2048)],
    fused_add_rms_norm=[(1, 4096), (8192, 4096), (8192, 5120)],
    adaln=[(2, 2688, 2048, False), (2, 21504, 2048, False), (2, 2688, 2048, True)],
    gated_residual_adaln=[(2, 2688, 2048), (2, 21504, 2048)],
    gated_residual=[(2, 21504, 2048)],
    rope_rotate_half=[(1, 32, 8, 8192, 128), (1, 32, 8, 128, 128), (4, 32, 8, 4096, 128)],
    rope_ltx=[(2, 2688, 2048), (2, 21504, 2048)],
    geglu=[(8192, 5120), (5376, 8192), (8192, 16384)],
    gelu_tanh=[(2, 2688, 8192)],
    gelu_mul=[(8192, 12288)],  # Gemma MLP
    quick=frozenset({
        ("rms_norm", (128, 4096)), ("rms_norm", (8192, 4096)), ("rms_norm", (648720, 128)),
        ("fused_add_rms_norm", (8192, 4096)), ("adaln", (2, 2688, 2048, False)), ("gated_residual_adaln", (2, 2688, 2048)),
        ("rope_rotate_half", (1, 32, 8, 8192, 128)), ("rope_rotate_half", (1, 32, 8, 128, 128)),
        ("rope_ltx", (2, 2688, 2048)), ("geglu", (8192, 5120)), ("gelu_tanh", (2, 2688, 8192)),
    }),
    backward=frozenset({
        ("rms_norm", (8192, 4096)), ("rms_norm", (32768, 4096)), ("fused_add_rms_norm", (8192, 4096)),
        ("adaln", (2, 21504, 2048, False)), ("gated_residual", (2, 21504, 2048)),
        ("gated_residual_adaln", (2, 21504, 2048)), ("rope_rotate_half", (1, 32, 8, 8192, 128)), ("rope_ltx", (2, 21504, 2048)),
        ("geglu", (8192, 16384)), ("gelu_tanh", (2, 2688, 8192)),
    }),
)

SMOKE = Shapes(
    rms_norm=[(4, 64), (3, 40)],
    rms_norm_no_weight=[(5, 32)],
    fused_add_rms_norm=[(4, 64)],
    adaln=[(2, 3, 64, False), (2, 3, 64, True)],
    gated_residual_adaln=[(2, 3, 64)],
    gated_residual=[(2, 3, 64)],
    rope_rotate_half=[(1, 4, 2, 6, 16)],
    rope_ltx=[(2, 5, 32)],
    geglu=[(4, 24)],
    gelu_tanh=[(2, 3, 16)],
    gelu_mul=[(4, 24)],
    backward=frozenset({("rms_norm", (4, 64)), ("fused_add_rms_norm", (4, 64)), ("adaln", (2, 3, 64, False)),
                        ("gated_residual_adaln", (2, 3, 64)), ("gated_residual", (2, 3, 64)),
                        ("rope_rotate_half", (1, 4, 2, 6, 16)),
                        ("rope_ltx", (2, 5, 32)), ("geglu", (4, 24)), ("gelu_tanh", (2, 3, 16))}),
)


# --- peers --------------------------------------------------------------------------------


@dataclass
class Libraries:
    """The optional peer libraries: imported modules, and why the others are missing."""

    modules: Dict[str, object] = field(default_factory=dict)
    missing: Dict[str, str] = field(default_factory=dict)

    def attr(self, library: str, name: str) -> Optional[Callable]:
        return getattr(self.modules.get(library), name, None)


def load_libraries(on_cuda: bool) -> Libraries:
    libs = Libraries()
    for key, module in PEER_LIBRARIES.items():
        if not on_cuda:
            libs.missing[key] = "needs CUDA"
            continue
        try:
            libs.modules[key] = importlib.import_module(module)
        except Exception as e:  # not installed, or fails to start here (driver, CUDA toolkit)
            libs.missing[key] = f"{type(e).__name__}: {first_line(e)}"
    return libs


# --- cases --------------------------------------------------------------------------------


@dataclass
class Case:
    """One op at one shape. ``inputs()`` makes one input set on the run's device;
    ``impls`` maps a name to a callable on an input set ("eager" is also the reference).
    ``backward`` is how a forward case times forward+backward: (inputs that get gradients,
    inputs the backward reads again); () where the op has none. A forward+backward case
    has ``grad_argnums`` (its input set is ``(inputs, grad_outputs)``) and
    ``backward_reads`` (for the byte count)."""

    op: str
    shape: str
    inputs: Callable[[], tuple]
    impls: Dict[str, Callable]
    quick: bool = False
    grad_argnums: Tuple[int, ...] = ()
    backward_reads: Tuple[int, ...] = ()
    backward: Tuple[Tuple[int, ...], Tuple[int, ...]] = ()


def flatten(obj) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in flatten(o)]
    return []


def size_of(obj) -> int:
    return sum(t.numel() * t.element_size() for t in flatten(obj))


def rotate_half_inputs(b: int, hq: int, hkv: int, s: int, d: int, device, dtype=BF16) -> tuple:
    """q [b, hq, s, d], k [b, hkv, s, d] as views of [B, S, H, D] projections (as
    transformers' attention makes them) and cos, sin [b, s, d] with equal halves (as
    transformers' rotary embeddings build them)."""
    q, k = (torch.randn(b, s, h, d, device=device, dtype=dtype).transpose(1, 2) for h in (hq, hkv))
    angle = torch.rand(b, s, d // 2, device=device)
    table = torch.cat([angle, angle], -1)
    return q, k, table.cos().to(dtype), table.sin().to(dtype)


def as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def bytes_moved(case: Case, inputs: tuple, expected) -> int:
    """Each input read once, each output written once; forward+backward adds the output
    gradients read, the input gradients written and what the backward re-reads."""
    if not case.grad_argnums:
        return size_of(inputs) + sum(t.numel() for t in flatten(expected)) * flatten(inputs)[0].element_size()
    leaves, grad_outputs = inputs
    forward = size_of(leaves) + size_of(grad_outputs)  # outputs are the grad_outputs' sizes
    backward = (size_of(grad_outputs) + size_of([leaves[i] for i in case.grad_argnums])
                + size_of([leaves[i] for i in case.backward_reads]))
    return forward + backward


def forward_backward(fn: Callable, grad_argnums: Tuple[int, ...]) -> Callable:
    def run(inputs, grad_outputs):
        outputs = as_tuple(fn(*inputs))
        # autograd.grad (not .backward) raises when an op has no autograd kernel, where
        # .backward would warn and leave the gradient None.
        try:
            return torch.autograd.grad(outputs, [inputs[i] for i in grad_argnums], grad_outputs)
        except RuntimeError as e:
            if "not have been used in the graph" in str(e) or "does not require grad" in str(e):
                raise RuntimeError("no autograd for this op (no gradient reaches its inputs)") from e
            raise
    return run


def with_backward(case: Case) -> Case:
    """The forward+backward case of a forward case that has a backward."""
    grad_argnums, backward_reads = case.backward
    forward_inputs, eager = case.inputs, case.impls["eager"]

    def inputs():
        args = forward_inputs()
        for i in grad_argnums:
            args[i].requires_grad_()
        with torch.no_grad():
            grad_outputs = tuple(torch.randn_like(o) for o in as_tuple(eager(*args)))
        return args, grad_outputs

    impls = {name: forward_backward(fn, grad_argnums) for name, fn in case.impls.items()}
    return Case(case.op + " fwd+bwd", case.shape, inputs, impls, False, grad_argnums, backward_reads)


class CompileFellBack(RuntimeError):
    """torch.compile ran the code eagerly (no graph compiled for the call): a compile peer
    that would be timed as eager."""


def configure_dynamo():
    """Every shape compiles, and a recompile past the limit raises rather than running the
    code eagerly (the runs also reset dynamo per case)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across releases
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 4096))
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 1 << 16))
    if hasattr(config, "fail_on_recompile_limit_hit"):
        config.fail_on_recompile_limit_hit = True
    config.suppress_errors = False


def graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compiled(fn: Callable, backend: str) -> Callable:
    """torch.compile of fn as one graph per shape (fullgraph: a graph break raises). Its first
    call must compile a graph: where dynamo compiles none (a skipped frame, a cache past its
    limit), it raises CompileFellBack instead of returning what fn computed eagerly."""
    compiled_fn = torch.compile(fn, dynamic=False, fullgraph=True, backend=backend)
    checked = []

    def run(*args):
        if checked:
            return compiled_fn(*args)
        before = graphs_compiled()
        out = compiled_fn(*args)
        if graphs_compiled() == before:
            raise CompileFellBack("torch.compile compiled no graph for this call: dynamo ran it eagerly")
        checked.append(True)
        return out

    return run


class CaseBuilder:
    """Builds the cases of a run: one device, one set of peer libraries, the ltx module. Each
    ``*_case`` method makes one op's case at one shape and dtype (the sweep calls them per
    cell); ``build`` makes those of a Shapes table."""

    def __init__(self, ltx, libs: Libraries, device: str, shapes: Optional[Shapes] = None,
                 compile_peer: bool = True):
        self.ltx, self.libs, self.device, self.shapes = ltx, libs, device, shapes
        self.compile_peer = compile_peer
        self.ref = ltx.reference  # the host libraries' code: the eager and compiled peers
        self.cases: List[Case] = []

    def randn(self, *shape, dtype=BF16, scale=1.0) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=dtype) * scale

    def peers(self, eager: Callable, **others: Optional[Callable]) -> Dict[str, Callable]:
        impls = {"eager": eager}
        if self.compile_peer:
            # On the CPU (smoke) dynamo only traces: inductor's C++ codegen takes minutes there.
            impls["compile"] = compiled(eager, "inductor" if self.device == "cuda" else "eager")
        impls.update({name: fn for name, fn in others.items() if fn})  # None/False: library or layout missing
        impls["ltx"] = impls.pop("ltx")  # last, after the peers it is compared with
        return impls

    # --- one case per op, shape and dtype ---

    def rms_norm_case(self, rows: int, d: int, dtype=BF16) -> Case:
        ltx, liger = self.ltx, self.libs.attr("liger", "LigerRMSNormFunction")
        quack = self.libs.attr("quack", "rmsnorm")

        def inputs():
            return self.randn(rows, d, dtype=dtype), 1 + self.randn(d, dtype=dtype, scale=0.1)
        impls = self.peers(
            self.ref.llama_rms_norm,
            **{"F.rms_norm": lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6),
               "liger": liger and (lambda x, w: liger.apply(x, w, 1e-6)),
               "quack": quack and (lambda x, w: quack(x, w, eps=1e-6)),
               "ltx": lambda x, w: ltx.rms_norm(x, w, 1e-6, cast_before_weight=True)})
        return Case("rms_norm", f"{rows}x{d} {dtype_name(dtype)}", inputs, impls, backward=((0, 1), (0, 1)))

    def rms_norm_no_weight_case(self, rows: int, d: int, dtype=BF16) -> Case:
        ltx, liger = self.ltx, self.libs.attr("liger", "LigerRMSNormFunction")
        quack = self.libs.attr("quack", "rmsnorm")

        def inputs():
            return (self.randn(rows, d, dtype=dtype),)
        impls = self.peers(
            self.ref.diffusers_rms_norm,
            **{"F.rms_norm": lambda x: F.rms_norm(x, x.shape[-1:], None, 1e-6),
               "liger": liger and (lambda x: liger.apply(x, None, 1e-6)),
               "quack": quack and (lambda x: quack(x, None, eps=1e-6)),
               "ltx": lambda x: ltx.rms_norm(x, None, 1e-6)})
        return Case("rms_norm", f"{rows}x{d} {dtype_name(dtype)} no weight", inputs, impls)

    def fused_add_rms_norm_case(self, rows: int, d: int, dtype=BF16) -> Case:
        """A decoder layer's residual add and next norm: h = x + residual, y = norm(h) in
        Llama's cast order; returns (y, h)."""
        ltx, liger = self.ltx, self.libs.attr("liger", "LigerFusedAddRMSNormFunction")
        quack = self.libs.attr("quack", "rmsnorm")

        def inputs():
            return (self.randn(rows, d, dtype=dtype), self.randn(rows, d, dtype=dtype),
                    1 + self.randn(d, dtype=dtype, scale=0.1))

        def eager(x, residual, w):
            h = x + residual
            return self.ref.llama_rms_norm(h, w), h
        impls = self.peers(
            eager,
            **{"F.rms_norm": lambda x, r, w: (F.rms_norm(h := x + r, h.shape[-1:], w, 1e-6), h),
               "liger": liger and (lambda x, r, w: liger.apply(x, r, w, 1e-6, 0.0, "llama")),
               "quack": quack and (lambda x, r, w: quack(x, w, residual=r, eps=1e-6, prenorm=True)),
               "ltx": lambda x, r, w: ltx.fused_add_rms_norm(x, r, w, 1e-6, cast_before_weight=True)})
        return Case("fused_add_rms_norm", f"{rows}x{d} {dtype_name(dtype)}", inputs, impls,
                    backward=((0, 1, 2), (0, 2)))

    def adaln_case(self, norm: str, b: int, s: int, d: int, per_token: bool, dtype=BF16) -> Case:
        ltx, liger = self.ltx, self.libs.attr("liger", "LigerModulatedRMSNormFunction")

        def inputs():
            mod = (b, s, d) if per_token else (b, 1, d)
            return (self.randn(b, s, d, dtype=dtype), self.randn(*mod, dtype=dtype, scale=0.1),
                    self.randn(*mod, dtype=dtype, scale=0.1))
        others = {"ltx": lambda x, sc, sh: ltx.adaln(x, sc, sh, 1e-6, norm=norm)}
        if norm == "rms":
            others["F.rms_norm"] = self.ref.adaln_with_torch_rms_norm
            others["liger"] = liger and (lambda x, sc, sh: liger.apply(x, None, sc, sh, 1e-6))
        modulation = "per-token" if per_token else f"[{b},1,{d}]"
        return Case(f"adaln_{norm}", f"[{b},{s},{d}] scale/shift {modulation}{dtype_suffix(dtype)}", inputs,
                    self.peers(self.ref.adaln(norm), **others), backward=((0, 1, 2), (0, 1)))

    def gated_residual_case(self, b: int, s: int, d: int, dtype=BF16) -> Case:
        ltx = self.ltx

        def inputs():
            return (self.randn(b, s, d, dtype=dtype), self.randn(b, s, d, dtype=dtype),
                    self.randn(b, 1, d, dtype=dtype, scale=0.1))
        return Case("gated_residual", f"[{b},{s},{d}], [{b},1,{d}] gate{dtype_suffix(dtype)}", inputs,
                    self.peers(lambda r, x, g: r + x * g, ltx=lambda r, x, g: ltx.gated_residual(r, x, g)),
                    backward=((0, 1, 2), (1, 2)))

    def gated_residual_adaln_case(self, norm: str, b: int, s: int, d: int, dtype=BF16) -> Case:
        ltx = self.ltx

        def inputs():
            return (self.randn(b, s, d, dtype=dtype), self.randn(b, s, d, dtype=dtype),
                    *(self.randn(b, 1, d, dtype=dtype, scale=0.1) for _ in range(3)))
        impls = self.peers(self.ref.gated_residual_adaln(norm),
                           ltx=lambda r, x, g, sc, sh: ltx.gated_residual_adaln(r, x, g, sc, sh, 1e-6, norm=norm))
        # The backward re-reads x and the saved sum (the residual's size).
        return Case(f"gated_residual_adaln_{norm}", f"[{b},{s},{d}], [{b},1,{d}] gate/scale/shift{dtype_suffix(dtype)}",
                    inputs, impls, backward=((0, 1, 2, 3, 4), (0, 1)))

    def rope_rotate_half_case(self, b: int, hq: int, hkv: int, s: int, d: int, dtype=BF16) -> Case:
        ltx, liger = self.ltx, self.libs.attr("liger", "LigerRopeFunction")
        quack_rotary = self.libs.attr("quack.rotary", "apply_rotary_emb")

        def inputs():
            return rotate_half_inputs(b, hq, hkv, s, d, self.device, dtype)

        def quack_rope(q, k, cos, sin):
            # flash-attn layout: x [B, S, H, D], tables [S, D/2] shared by the batch (B = 1 only).
            half = cos.shape[-1] // 2
            return tuple(quack_rotary(x.transpose(1, 2), cos[0, :, :half], sin[0, :, :half]).transpose(1, 2)
                         for x in (q, k))
        impls = self.peers(self.ref.transformers_rope,
                           liger=liger and (lambda q, k, c, sn: liger.apply(q, k, c, sn)),
                           quack=quack_rotary and b == 1 and quack_rope,
                           ltx=lambda q, k, c, sn: ltx.rope_rotate_half(q, k, c, sn))
        return Case("rope_rotate_half", f"q[{b},{hq},{s},{d}] k[{b},{hkv},{s},{d}]{dtype_suffix(dtype)}", inputs,
                    impls, backward=((0, 1), (2, 3)))

    def ltx_rope_inputs(self, b: int, s: int, c: int, dtype=BF16) -> tuple:
        """LTX-Video's q, k [b, s, c] and its fp32 [b, s, c] tables of pairs."""
        angle = torch.rand(b, s, c // 2, device=self.device).repeat_interleave(2, -1)
        return self.randn(b, s, c, dtype=dtype), self.randn(b, s, c, dtype=dtype), angle.cos(), angle.sin()

    def rope_interleaved_case(self, b: int, s: int, c: int, dtype=BF16) -> Case:
        ltx = self.ltx
        return Case("rope_interleaved", f"LTX q/k [{b},{s},{c}], fp32 tables{dtype_suffix(dtype)}",
                    lambda: self.ltx_rope_inputs(b, s, c, dtype),
                    self.peers(self.ref.ltx_rope, ltx=lambda q, k, co, si: ltx.rope_interleaved(q, k, co, si)),
                    backward=((0, 1), (2, 3)))

    def qk_norm_rope_case(self, b: int, s: int, c: int, dtype=BF16) -> Case:
        ltx = self.ltx

        def inputs():
            q, k, cos, sin = self.ltx_rope_inputs(b, s, c, dtype)
            return (q, k, *(1 + self.randn(c, dtype=dtype, scale=0.1) for _ in range(2)), cos, sin)
        return Case("qk_norm_rope", f"LTX q/k [{b},{s},{c}]{dtype_suffix(dtype)}", inputs,
                    self.peers(self.ref.ltx_qk_norm_rope,
                               ltx=lambda q, k, wq, wk, co, si: ltx.qk_norm_rope(q, k, wq, wk, co, si, 1e-5)))

    def geglu_case(self, rows: int, h: int, dtype=BF16) -> Case:
        ltx = self.ltx
        return Case("geglu", f"[{rows}, 2x{h}]{dtype_suffix(dtype)}", lambda: (self.randn(rows, 2 * h, dtype=dtype),),
                    self.peers(self.ref.diffusers_geglu, ltx=lambda x: ltx.geglu(x, "none")),
                    backward=((0,), (0,)))

    def gelu_tanh_case(self, shape: Tuple[int, ...], dtype=BF16) -> Case:
        ltx = self.ltx
        return Case("gelu_tanh", "[" + ",".join(map(str, shape)) + "]" + dtype_suffix(dtype),
                    lambda: (self.randn(*shape, dtype=dtype),),
                    self.peers(self.ref.gelu_tanh, ltx=lambda x: ltx.gelu(x, "tanh")), backward=((0,), (0,)))

    def gelu_mul_case(self, rows: int, d: int, dtype=BF16) -> Case:
        ltx, liger = self.ltx, self.libs.attr("liger", "LigerGELUMulFunction")
        return Case("gelu_mul", f"[{rows}, {d}] (Gemma MLP){dtype_suffix(dtype)}",
                    lambda: (self.randn(rows, d, dtype=dtype), self.randn(rows, d, dtype=dtype)),
                    self.peers(self.ref.gemma_gelu_mul, liger=liger and (lambda g, u: liger.apply(g, u)),
                               ltx=lambda g, u: ltx.gelu_mul(g, u, "tanh")),
                    backward=((0, 1), (0, 1)))

    # --- the model shapes ---

    def add(self, family: str, key: tuple, case: Case, dtype=BF16):
        listed = dtype == BF16 and self.shapes is not None
        case.quick = listed and (family, key) in self.shapes.quick
        self.cases.append(case)
        if case.backward and listed and (family, key) in self.shapes.backward:
            self.cases.append(with_backward(case))

    def build(self) -> List[Case]:
        shapes = self.shapes
        for dtype in (BF16, FP16, FP32):
            for key in shapes.rms_norm:
                self.add("rms_norm", key, self.rms_norm_case(*key, dtype), dtype)
            for key in shapes.rms_norm_no_weight:
                self.add("rms_norm_no_weight", key, self.rms_norm_no_weight_case(*key, dtype), dtype)
        for key in shapes.fused_add_rms_norm:
            self.add("fused_add_rms_norm", key, self.fused_add_rms_norm_case(*key))
        for norm in ("rms", "layer"):
            for key in shapes.adaln:
                self.add("adaln", key, self.adaln_case(norm, *key))
            for key in shapes.gated_residual_adaln:
                self.add("gated_residual_adaln", key, self.gated_residual_adaln_case(norm, *key))
        for key in shapes.gated_residual:
            self.add("gated_residual", key, self.gated_residual_case(*key))
        for key in shapes.rope_rotate_half:
            self.add("rope_rotate_half", key, self.rope_rotate_half_case(*key))
        for key in shapes.rope_ltx:
            self.add("rope_ltx", key, self.rope_interleaved_case(*key))
            self.add("rope_ltx", key, self.qk_norm_rope_case(*key))
        for key in shapes.geglu:
            self.add("geglu", key, self.geglu_case(*key))
        for key in shapes.gelu_tanh:
            self.add("gelu_tanh", key, self.gelu_tanh_case(key))
        for key in shapes.gelu_mul:
            self.add("gelu_mul", key, self.gelu_mul_case(*key))
        return self.cases


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_suffix(dtype: torch.dtype) -> str:
    """The shape label's dtype: bf16 (most ops' only dtype in the model shapes) goes unsaid."""
    return "" if dtype == BF16 else f" {dtype_name(dtype)}"


# --- running ------------------------------------------------------------------------------


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:160] if text else ""


def to_fp64(obj):
    """fp64 copies of an input set (leaves keep requires_grad) for the reference."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().double().requires_grad_(obj.requires_grad) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_fp64(o) for o in obj)
    return obj


def private_copy(obj):
    """A copy of an input set, strides kept, for one implementation's checked call: Liger's
    RoPE rotates its inputs in place and its RMSNorm backward overwrites the output
    gradients, which would skew the error of every implementation checked after it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone().requires_grad_(obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        return type(obj)(private_copy(o) for o in obj)
    return obj


# An implementation whose max abs error is over WRONG_FACTOR times every other's (plus
# WRONG_FLOOR) computed something else: rounding differs by less (the eager code's own, of
# several roundings, reached 3.9x the others' on adaln_layer), a broken kernel's error is
# the size of its outputs. Its row is skipped with the reason rather than timed.
WRONG_FACTOR, WRONG_FLOOR = 16.0, 1e-5


class WrongResult(RuntimeError):
    pass


def wrong_results(errors: Dict[str, object]) -> Dict[str, WrongResult]:
    """The checked implementations (errors: name -> max abs error, or the exception the check
    raised) whose error sets them apart from all the others."""
    measured = {name: err for name, err in errors.items() if isinstance(err, float)}
    wrong = {}
    for name, err in measured.items():
        others = [e for other, e in measured.items() if other != name]
        if others and err > WRONG_FACTOR * max(others) + WRONG_FLOOR:
            wrong[name] = WrongResult(f"max abs err {err:.1e}, over {WRONG_FACTOR:.0f}x every other "
                                      f"implementation's (at most {max(others):.1e})")
    return wrong


def max_error(actual, expected) -> float:
    pairs = list(zip(flatten(actual), flatten(expected)))
    if len(pairs) != len(flatten(expected)):
        raise RuntimeError(f"returned {len(flatten(actual))} tensors, the reference {len(flatten(expected))}")
    return max((a.double() - e.double()).abs().max().item() for a, e in pairs)


@dataclass(frozen=True)
class Timing:
    """How a run times a case. On CUDA: input sets rotated past L2 (at most ``max_copies``;
    a case too small for that runs L2-resident, see harness.l2_resident),
    at least harness.MIN_GRAPH_BYTES of calls a graph (at most ``max_calls``), ``replays``
    graph replays and ``eager_batches`` eager batches of about ``eager_batch_us`` each. On
    the CPU: ``cpu_rounds`` interleaved rounds of every implementation (harness.cpu_times_us)."""

    max_copies: Optional[int] = None
    max_calls: Optional[int] = None
    replays: int = 25
    eager_batches: int = 7
    eager_batch_us: float = 2e4
    cpu_rounds: int = 5
    cpu_batch_us: float = 0.0


class Runner:
    """Times the cases and keeps the rows: results, skips, and the table lines."""

    COLUMNS = ("op", "shape", "impl", "kernel us", "eager us", "MB moved", "GB/s", "% copy BW",
               "% same-size copy", "ltx / best peer (kernel)", "ltx / best peer (eager)", "max abs err")

    def __init__(self, on_cuda: bool, copy_gbs: float, timing: Timing = Timing()):
        self.on_cuda, self.copy_gbs, self.timing = on_cuda, copy_gbs, timing
        self.copy_us_by_bytes: Dict[int, float] = {}
        self.rows: List[dict] = []
        self.skipped: List[dict] = []
        self.lines: List[str] = []

    def emit(self, line: str = ""):
        self.lines.append(line)
        print(line, flush=True)

    def header(self):
        self.emit("| " + " | ".join(self.COLUMNS) + " |")
        self.emit("|" + "---|" * len(self.COLUMNS))

    def run(self, cases: Sequence[Case]):
        self.header()
        for case in cases:
            self.run_one(case)

    def run_one(self, case: Case) -> List[dict]:
        """Times one case; keeps and prints its rows (with the comparison to the peers)."""
        try:
            entries = self.run_case(case)
        except Exception as e:  # input set or reference failed (e.g. out of memory)
            entries = [self.skip(case, "all", e)]
        finally:
            self.release()
        self.compare_with_peers([e for e in entries if "reason" not in e])
        for entry in entries:
            (self.skipped if "reason" in entry else self.rows).append(entry)
            self.emit(self.format(entry))
        return entries

    def run_case(self, case: Case) -> List[dict]:
        """A row per implementation: its timings, or why it was skipped."""
        sets = [case.inputs()]
        copies = harness.copies_for_cold_l2(size_of(sets[0]), self.timing.max_copies) if self.on_cuda else 1
        sets += [case.inputs() for _ in range(copies - 1)]
        expected = case.impls["eager"](*to_fp64(sets[0]))
        nbytes = bytes_moved(case, sets[0], expected)
        calls = harness.calls_per_graph(copies, nbytes, self.timing.max_calls) if self.on_cuda else 1
        copy_us = self.same_size_copy_us(nbytes)
        # Every check runs before any timing: a peer that writes into its inputs (Liger's
        # RoPE, in place) while it is timed must not change what the others are checked on.
        errors = {}
        for name, fn in case.impls.items():
            try:
                errors[name] = max_error(fn(*private_copy(sets[0])), expected)
            except Exception as e:  # a peer without this layout, dtype or autograd
                errors[name] = e
        errors.update(wrong_results(errors))
        checked = {name: fn for name, fn in case.impls.items() if not isinstance(errors[name], Exception)}
        outcomes = self.time_all(checked, sets, calls)
        rows = []
        for name in case.impls:
            outcome = errors[name] if isinstance(errors[name], Exception) else outcomes[name]
            if isinstance(outcome, Exception):
                rows.append(self.skip(case, name, outcome))
                continue
            kernel_us, eager_us = outcome
            seconds = kernel_us if kernel_us is not None else eager_us
            gbs = nbytes / seconds / 1e3
            rows.append(dict(op=case.op, shape=case.shape, impl=name, kernel_us=kernel_us, eager_us=eager_us,
                             bytes=nbytes, gbs=gbs, pct_copy=100 * gbs / self.copy_gbs,
                             pct_same_size_copy=None if copy_us is None else 100 * copy_us / seconds,
                             max_abs_err=errors[name]))
        return rows

    def same_size_copy_us(self, nbytes: int) -> Optional[float]:
        if not self.on_cuda:
            return None
        if nbytes not in self.copy_us_by_bytes:
            self.copy_us_by_bytes[nbytes] = harness.same_size_copy_us(nbytes, self.timing.max_copies,
                                                                      self.timing.max_calls)
        return self.copy_us_by_bytes[nbytes]

    def time_all(self, impls: Dict[str, Callable], sets: List[tuple], calls: int) -> Dict[str, object]:
        """name -> (kernel us or None, eager us), or the exception its timing raised. On the
        CPU the implementations are timed in interleaved rounds, so that a load that comes
        and goes weighs on each alike."""
        outcomes: Dict[str, object] = {}
        if not self.on_cuda:
            runnable = {}
            for name, fn in impls.items():
                try:
                    fn(*sets[0])
                    runnable[name] = lambda fn=fn: fn(*sets[0])
                except Exception as e:
                    outcomes[name] = e
            times = harness.cpu_times_us(runnable, self.timing.cpu_rounds, self.timing.cpu_batch_us)
            outcomes.update({name: (None, us) for name, us in times.items()})
            return outcomes
        for name, fn in impls.items():
            try:
                outcomes[name] = self.time_cuda(fn, sets, calls)
            except Exception as e:
                outcomes[name] = e
                self.synchronize()
        return outcomes

    def time_cuda(self, fn: Callable, sets: List[tuple], calls: int) -> Tuple[float, float]:
        rotated = [lambda s=sets[i % len(sets)]: fn(*s) for i in range(calls)]
        hold = not harness.l2_resident(len(sets), size_of(sets[0]))
        kernel_us = harness.graph_time_us(rotated, self.timing.replays, hold_outputs=hold)
        # About eager_batch_us of calls per batch: many for small shapes, few for large.
        batch = int(min(200, max(5, self.timing.eager_batch_us / kernel_us)))
        return kernel_us, harness.eager_time_us(rotated[:len(sets)], batch=batch, batches=self.timing.eager_batches)

    def synchronize(self):
        if self.on_cuda:
            try:  # an asynchronous failure surfaces here, not in the next implementation
                torch.cuda.synchronize()
            except Exception:
                pass  # a broken context: the next calls fail too and are skipped with their reason

    def skip(self, case: Case, impl: str, error: BaseException) -> dict:
        self.synchronize()
        return dict(op=case.op, shape=case.shape, impl=impl, reason=f"{type(error).__name__}: {first_line(error)}")

    def release(self):
        try:
            if self.on_cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            torch._dynamo.reset()  # each case compiles afresh: no recompile limit across shapes
        except Exception as e:  # a broken CUDA context: later cases skip, the report is still written
            self.emit(f"(cleanup failed: {type(e).__name__}: {first_line(e)})")

    @staticmethod
    def compare_with_peers(rows: List[dict]):
        ours = next((r for r in rows if r["impl"] == "ltx"), None)
        peers = [r for r in rows if r["impl"] != "ltx"]
        if ours is None or not peers:
            return
        for timing in ("kernel_us", "eager_us"):
            timed = [r for r in peers if r[timing] is not None]
            if ours[timing] is not None and timed:
                best = min(timed, key=lambda r: r[timing])
                ours[f"vs_best_peer_{timing}"] = dict(peer=best["impl"], ratio=ours[timing] / best[timing])

    def format(self, row: dict) -> str:
        if "reason" in row:
            return f"| {row['op']} | {row['shape']} | {row['impl']} | skipped: {row['reason'].replace('|', '/')} |" \
                + " |" * (len(self.COLUMNS) - 4)

        def us(value):
            return "–" if value is None else f"{value:.1f}"

        def versus(timing):
            best = row.get(f"vs_best_peer_{timing}")
            return f"{best['ratio']:.2f} ({best['peer']})" if best else ""

        cells = (row["op"], row["shape"], row["impl"], us(row["kernel_us"]), us(row["eager_us"]),
                 f"{row['bytes'] / 1e6:.1f}", f"{row['gbs']:.0f}", f"{row['pct_copy']:.0f}%",
                 "–" if row["pct_same_size_copy"] is None else f"{row['pct_same_size_copy']:.0f}%", versus("kernel_us"), versus("eager_us"), f"{row['max_abs_err']:.1e}")
        return "| " + " | ".join(cells) + " |"


# --- main ---------------------------------------------------------------------------------


def select(cases: List[Case], args) -> List[Case]:
    ops = set(args.ops.split(",")) if args.ops else None

    def wanted(case: Case) -> bool:
        base = case.op.removesuffix(" fwd+bwd")
        if ops and base not in ops:
            return False
        if case.grad_argnums:
            return args.backward
        return case.quick or not args.quick or args.smoke

    return [c for c in cases if wanted(c)]


def default_stem(args) -> Path:
    """benchmarks/results/ keeps the latest run of each kind, under a name without a date."""
    mode = "bench_ops" + ("_quick" if args.quick else "") + ("_backward" if args.backward else "")
    if args.ops:
        mode += "_" + args.ops.replace(",", "_")
    return RESULTS / mode


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a representative subset of shapes (bf16)")
    parser.add_argument("--ops", help="comma-separated op names, e.g. rms_norm,adaln_rms,geglu (default: all)")
    parser.add_argument("--backward", action="store_true",
                        help="also time forward+backward on the large shapes (ltx rows skip if it has no autograd)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no CUDA graphs (for CI)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write a PNG of %% copy bandwidth per shape here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args()

    on_cuda = not args.smoke
    # An op without autograd says so in its skipped row; torch's warning would repeat it.
    warnings.filterwarnings("ignore", message=".*autograd kernel was not registered")
    if on_cuda and not torch.cuda.is_available():
        sys.exit("bench_ops: needs a CUDA GPU (or --smoke for the CPU)")
    device_name = torch.cuda.get_device_name() if on_cuda else "CPU (smoke)"
    if not (args.json or args.plot or args.markdown or args.smoke):
        stem = default_stem(args)
        args.json, args.plot, args.markdown = (stem.with_suffix(s) for s in (".json", ".png", ".md"))
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("bench_ops: matplotlib is not installed: no plot (JSON and table as usual)", flush=True)
        args.plot = None
    from kernels import get_local_kernel

    ltx = get_local_kernel(REPO)
    libs = load_libraries(on_cuda)
    configure_dynamo()
    cases = select(CaseBuilder(ltx, libs, "cuda" if on_cuda else "cpu", SMOKE if args.smoke else MODEL_SHAPES).build(),
                   args)
    copy_gbs = harness.copy_bandwidth_gbs() if on_cuda else harness.cpu_copy_bandwidth_gbs()

    runner = Runner(on_cuda, copy_gbs)
    versions = harness.library_versions()
    runner.emit(f"# bench_ops on {device_name}, {datetime.date.today().isoformat()}")
    runner.emit()
    runner.emit(f"Command: `python -m benchmarks.ops.bench_ops {' '.join(sys.argv[1:])}`; kernel build {ltx.__name__}; "
                + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".")
    runner.emit(f"Copy bandwidth measured in this run: {copy_gbs:.0f} GB/s (read + write). "
                + ("Kernel time: CUDA-graph replay, inputs and outputs rotated past L2, median. "
                   "Eager: back-to-back Python calls over the same rotated inputs, median."
                   if on_cuda else "Smoke run: CPU wall time only; GB/s from it."))
    for name, reason in libs.missing.items():
        runner.emit(f"Peer {name} not run: {reason}.")
    runner.emit()
    runner.run(cases)

    report = dict(device=device_name, date=datetime.date.today().isoformat(), argv=sys.argv[1:],
                  kernel_build=ltx.__name__, versions=versions, copy_gbs=copy_gbs,
                  timing="cuda-graph kernel + eager" if on_cuda else "cpu eager (smoke)",
                  peers_missing=libs.missing, results=runner.rows, skipped=runner.skipped)
    write_outputs(args, report, runner.lines)
    wrong = [row for row in runner.skipped if row["impl"] == "ltx" and row["reason"].startswith(WrongResult.__name__)]
    if wrong:
        sys.exit("bench_ops: ltx computed wrong results: "
                 + "; ".join(f"{row['op']} {row['shape']} ({row['reason']})" for row in wrong))


def write_outputs(args, report: dict, lines: List[str]):
    written = [path for path in (args.json, args.markdown, args.plot) if path]
    for path in written:
        path.parent.mkdir(parents=True, exist_ok=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")
    if args.plot:
        from benchmarks.ops import plot  # matplotlib only when a plot is asked for

        plot.save_copy_bandwidth_plot(report, args.plot)
    if written:
        print("wrote " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
