"""Every op against its peers on the model shapes it serves: our kernel, the PyTorch eager
code the host library runs, torch.compile of that code (dynamic=False), F.rms_norm where
it applies, and Liger-Kernel where it has the op (skipped when not installed).

    python benchmarks/bench_ops.py [--quick] [--ops rms_norm,rope,...] [--json out.json]

Prints a Markdown table: kernel time (CUDA graph, cold L2, median), eager call time, the
bytes an op must move, GB/s and % of the copy bandwidth measured in the same run, and the
max abs error against an fp64 evaluation of the eager code.
"""

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import copies_for_cold_l2, copy_bandwidth_gbs, eager_time_us, graph_time_us  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16


@dataclass
class Case:
    """One op at one shape: inputs(), the implementations ("eager" is also the reference),
    and the bytes a call must move."""

    op: str
    shape: str
    inputs: Callable[[], tuple]
    impls: Dict[str, Callable]
    nbytes: int
    quick: bool = False


def size_of(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --- eager references, as the host libraries write them -----------------------------------


def llama_rms_norm(x, w, eps=1e-6):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def diffusers_rms_norm(x, eps=1e-6):
    h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype)


def adaln_eager(norm):
    def run(x, scale, shift):
        n = diffusers_rms_norm(x) if norm == "rms" else F.layer_norm(x, x.shape[-1:], eps=1e-6)
        return n * (1 + scale) + shift
    return run


def gated_adaln_eager(norm):
    def run(res, x, gate, scale, shift):
        h = res + x * gate
        return h, adaln_eager(norm)(h, scale, shift)
    return run


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def transformers_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def ltx_rope_one(x, cos, sin):
    real, imag = x.unflatten(2, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def ltx_prologue(q, k, wq, wk, cos, sin):
    q = F.rms_norm(q, q.shape[-1:], wq, 1e-5)
    k = F.rms_norm(k, k.shape[-1:], wk, 1e-5)
    return ltx_ropes(q, k, cos, sin)


def ltx_ropes(q, k, cos, sin):
    return ltx_rope_one(q, cos, sin), ltx_rope_one(k, cos, sin)


def diffusers_geglu(x):
    value, gate = x.chunk(2, dim=-1)
    return value * F.gelu(gate)


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


# --- the cases -------------------------------------------------------------------------------


def liger():
    try:
        import liger_kernel.ops.geglu as lg
        import liger_kernel.ops.rms_norm as lr
        import liger_kernel.ops.rope as lrope
        return lr, lrope, lg
    except ImportError:
        return None


def peers(eager: Callable, **extra) -> Dict[str, Callable]:
    impls = {"eager": eager, "compile": torch.compile(eager, dynamic=False)}
    impls.update(extra)
    return impls


def cases(k) -> List[Case]:
    lig = liger()
    out: List[Case] = []

    rms_shapes = [(1024, 2048), (128, 4096), (4096, 4096), (8192, 4096), (32768, 4096), (32768, 8192),
                  (8192, 1536), (8192, 65536), (648720, 128)]
    for rows, d in rms_shapes:
        for dtype in (BF16, torch.float16, torch.float32):
            def inputs(rows=rows, d=d, dtype=dtype):
                return torch.randn(rows, d, device="cuda", dtype=dtype), torch.randn(d, device="cuda", dtype=dtype)
            impls = peers(llama_rms_norm,
                          **{"ltx": lambda x, w: k.rms_norm(x, w, 1e-6, cast_before_weight=True),
                             "F.rms_norm": lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6)})
            if lig:
                impls["liger"] = lambda x, w: lig[0].LigerRMSNormFunction.apply(x, w, 1e-6)
            e = torch.finfo(dtype).bits // 8
            out.append(Case("rms_norm", f"{rows}x{d} {str(dtype)[6:]}", inputs, impls, (2 * rows * d + d) * e,
                            quick=(rows, d) in ((128, 4096), (8192, 4096), (648720, 128)) and dtype == BF16))
    def ltx_no_weight():
        return (torch.randn(5376, 2048, device="cuda", dtype=BF16),)
    out.append(Case("rms_norm", "5376x2048 bf16 no weight", ltx_no_weight,
                    peers(diffusers_rms_norm, ltx=lambda x: k.rms_norm(x, None, 1e-6),
                          **{"F.rms_norm": lambda x: F.rms_norm(x, x.shape[-1:], None, 1e-6)}),
                    2 * 5376 * 2048 * 2))

    for norm in ("rms", "layer"):
        for b, s, per_token in ((2, 2688, False), (2, 21504, False), (2, 2688, True)):
            d = 2048
            def inputs(b=b, s=s, d=d, per_token=per_token):
                m = (b, s, d) if per_token else (b, 1, d)
                return (torch.randn(b, s, d, device="cuda", dtype=BF16),
                        torch.randn(m, device="cuda", dtype=BF16), torch.randn(m, device="cuda", dtype=BF16))
            mod = 2 * (b * s * d if per_token else b * d)
            out.append(Case(f"adaln_{norm}", f"[{b},{s},{d}] {'per-token' if per_token else '[B,1,D]'}", inputs,
                            peers(adaln_eager(norm), ltx=lambda x, sc, sh, norm=norm: k.adaln(x, sc, sh, 1e-6, norm=norm)),
                            (2 * b * s * d + mod) * 2, quick=(s == 2688 and not per_token)))
        for b, s in ((2, 2688), (2, 21504)):
            d = 2048
            def inputs(b=b, s=s, d=d):
                big = [torch.randn(b, s, d, device="cuda", dtype=BF16) for _ in range(2)]
                small = [torch.randn(b, 1, d, device="cuda", dtype=BF16) for _ in range(3)]
                return (*big, *small)
            out.append(Case(f"gated_residual_adaln_{norm}", f"[{b},{s},{d}]", inputs,
                            peers(gated_adaln_eager(norm),
                                  ltx=lambda r, x, g, sc, sh, norm=norm: k.gated_residual_adaln(r, x, g, sc, sh, 1e-6, norm=norm)),
                            (4 * b * s * d + 3 * b * d) * 2, quick=s == 2688))

    for b, hq, hkv, s in ((1, 32, 8, 8192), (1, 32, 8, 128), (4, 32, 8, 4096)):
        d = 128
        def inputs(b=b, hq=hq, hkv=hkv, s=s, d=d):
            q = torch.randn(b, s, hq, d, device="cuda", dtype=BF16).transpose(1, 2)
            kk = torch.randn(b, s, hkv, d, device="cuda", dtype=BF16).transpose(1, 2)
            ang = torch.rand(b, s, d // 2, device="cuda")
            emb = torch.cat([ang, ang], -1)
            return q, kk, emb.cos().to(BF16), emb.sin().to(BF16)
        impls = peers(transformers_rope, ltx=lambda q, kk, c, sn: k.rope_rotate_half(q, kk, c, sn))
        if lig:
            impls["liger"] = lambda q, kk, c, sn: lig[1].LigerRopeFunction.apply(q, kk, c, sn)
        out.append(Case("rope_rotate_half", f"q[{b},{hq},{s},{d}] k[{b},{hkv},{s},{d}]", inputs, impls,
                        2 * (b * (hq + hkv) * s * d) * 2 + 2 * b * s * d * 2, quick=s == 8192))

    for b, s in ((2, 2688), (2, 21504)):
        c = 2048
        def inputs(b=b, s=s, c=c):
            q, kk = (torch.randn(b, s, c, device="cuda", dtype=BF16) for _ in range(2))
            ang = torch.rand(b, s, c // 2, device="cuda").repeat_interleave(2, -1)
            return q, kk, ang.cos(), ang.sin()
        out.append(Case("rope_interleaved", f"LTX q/k [{b},{s},{c}], fp32 tables", inputs,
                        peers(ltx_ropes, ltx=lambda q, kk, co, si: k.rope_interleaved(q, kk, co, si)),
                        4 * b * s * c * 2 + 2 * b * s * c * 4, quick=s == 2688))
        def inputs_norm(b=b, s=s, c=c, rope_inputs=inputs):
            q, kk, co, si = rope_inputs(b, s, c)
            return q, kk, torch.randn(c, device="cuda", dtype=BF16), torch.randn(c, device="cuda", dtype=BF16), co, si
        out.append(Case("qk_norm_rope", f"LTX q/k [{b},{s},{c}]", inputs_norm,
                        peers(ltx_prologue, ltx=lambda q, kk, wq, wk, co, si: k.qk_norm_rope(q, kk, wq, wk, co, si, 1e-5)),
                        4 * b * s * c * 2 + 2 * b * s * c * 4, quick=s == 2688))

    for rows, h in ((8192, 5120), (5376, 8192), (8192, 16384)):
        def inputs(rows=rows, h=h):
            return (torch.randn(rows, 2 * h, device="cuda", dtype=BF16),)
        out.append(Case("geglu", f"[{rows}, 2x{h}]", inputs, peers(diffusers_geglu, ltx=lambda x: k.geglu(x, "none")),
                        3 * rows * h * 2, quick=h == 5120))
    def gelu_inputs():
        return (torch.randn(2, 2688, 8192, device="cuda", dtype=BF16),)
    out.append(Case("gelu_tanh", "[2,2688,8192]", gelu_inputs, peers(gelu_tanh, ltx=lambda x: k.gelu(x, "tanh")),
                    2 * 2 * 2688 * 8192 * 2, quick=True))
    def gelu_mul_inputs():
        return tuple(torch.randn(8192, 12288, device="cuda", dtype=BF16) for _ in range(2))
    impls = peers(lambda g, u: gelu_tanh(g) * u, ltx=lambda g, u: k.gelu_mul(g, u, "tanh"))
    if lig:
        impls["liger"] = lambda g, u: lig[2].LigerGELUMulFunction.apply(g, u)
    out.append(Case("gelu_mul", "[8192, 12288] (Gemma MLP)", gelu_mul_inputs, impls, 3 * 8192 * 12288 * 2))
    return out


def max_error(actual, expected) -> float:
    if isinstance(actual, (tuple, list)):
        return max(max_error(a, e) for a, e in zip(actual, expected))
    return (actual.double() - expected.double()).abs().max().item()


def run(selected: Sequence[Case], copy_gbs: float) -> List[dict]:
    rows = []
    print("| op | shape | impl | kernel us | eager us | GB/s | % copy BW | max abs err |")
    print("|---|---|---|---|---|---|---|---|")
    for case in selected:
        copies = copies_for_cold_l2(case.nbytes)
        sets = [case.inputs() for _ in range(copies)]
        # The eager code evaluated on fp64 copies of the inputs.
        reference = case.impls["eager"](*[t.double() if t.is_floating_point() else t for t in sets[0]])
        for name, fn in case.impls.items():
            try:
                err = max_error(fn(*sets[0]), reference)
                kernel_us = graph_time_us([lambda s=s: fn(*s) for s in sets])
                # About 20 ms of calls per batch: many for small shapes, few for large.
                batch = int(min(200, max(5, 2e4 / kernel_us)))
                eager_us = eager_time_us(lambda: fn(*sets[0]), batch=batch)
            except Exception as e:  # a peer lacking this layout or dtype
                print(f"| {case.op} | {case.shape} | {name} | n/a: {type(e).__name__} | | | | |", flush=True)
                continue
            gbs = case.nbytes / kernel_us / 1e3
            row = dict(op=case.op, shape=case.shape, impl=name, kernel_us=kernel_us, eager_us=eager_us,
                       bytes=case.nbytes, gbs=gbs, pct_copy=100 * gbs / copy_gbs, max_abs_err=err)
            rows.append(row)
            print(f"| {case.op} | {case.shape} | {name} | {kernel_us:.1f} | {eager_us:.1f} | {gbs:.0f} | "
                  f"{row['pct_copy']:.0f}% | {err:.1e} |", flush=True)
        sets.clear()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one or two shapes per op")
    parser.add_argument("--ops", help="comma-separated op names (default: all)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_ops: needs a CUDA GPU")
    from kernels import get_local_kernel

    k = get_local_kernel(REPO)
    selected = [c for c in cases(k) if (c.quick or not args.quick)
                and (not args.ops or c.op in args.ops.split(","))]
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  copy bandwidth: {copy_gbs:.0f} GB/s "
          f"(read + write)\n")
    rows = run(selected, copy_gbs)
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                             copy_gbs=copy_gbs, results=rows), indent=2))


if __name__ == "__main__":
    main()
