"""The FP8 producers (quantize_fp8, rms_norm_fp8, adaln_fp8, gated_residual_adaln_fp8,
gelu_fp8) against the PyTorch code a user writes for the same (q, per-row scales), eager and
under torch.compile, on a CUDA GPU of compute capability 8.9 or newer: kernel time by
CUDA-graph replay with inputs rotated past L2 (harness.py), % of the copy bandwidth
measured in the same run (bytes: 16-bit rows in, one byte an element and an fp32 scale a
row out, and the gated residual's 16-bit sum), and whether each peer's q and scales equal
ours bit for bit. Then the projection GEMMs of LTX-Video 2B (2 x 2688 tokens at 49
frames, 2 x 8064 at 161): bf16 ``F.linear`` against ``torch._scaled_mm`` on FP8 operands with
row-wise scales, standard and fast accumulation, and `FP8Linear` (its input's quantize
included), each output's relative L2 from the bf16 GEMM beside it.

    python -m benchmarks.ops.bench_fp8 [--reps 3] [--skip-gemms] [--ours-only]
    python -m benchmarks.ops.bench_fp8 --skip-gemms --shapes adaln_fp8:2x2688x2048,gelu_fp8:5376x8192
"""

import argparse
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.ops import bench_ops

REPO = Path(__file__).resolve().parents[2]
FP8, E4M3_MAX = torch.float8_e4m3fn, 448.0
# (op, shape): LTX-Video 2B's tokens (batch 2; 161 frames at 1024x1024, 21x32x32 latents),
# an LLM prefill (its feed-forward's 8192 wide GELU too), the 13B configuration's 4096 wide
# AdaLN, then the producers of the end-to-end forward (e2e_models: 49 frames at 512x768,
# 7x16x24 latents)
SHAPES = [("quantize_fp8", (2, 21504, 2048)), ("rms_norm_fp8", (2, 21504, 2048)), ("adaln_fp8", (2, 21504, 2048)),
          ("gated_residual_adaln_fp8", (2, 21504, 2048)), ("gelu_fp8", (2, 21504, 8192)),
          ("quantize_fp8", (8192, 4096)), ("rms_norm_fp8", (8192, 4096)), ("adaln_fp8", (2, 21504, 4096)),
          ("quantize_fp8", (2, 21504, 8192)),
          ("quantize_fp8", (2, 2688, 2048)), ("adaln_fp8", (2, 2688, 2048)),
          ("gated_residual_adaln_fp8", (2, 2688, 2048)), ("gelu_fp8", (2, 2688, 8192))]
# (M tokens, N out, K in): LTX-Video 2B's attention projections (q, k, v, out; fused qkv) and
# feed-forward (up, down), at 49 and 161 frames with CFG
GEMMS = [(m, n, k) for m in (5376, 16128) for n, k in ((2048, 2048), (6144, 2048), (8192, 2048), (2048, 8192))]


MODULATED = ("adaln_fp8", "gated_residual_adaln_fp8")  # their scale, shift (and gate) per batch entry


class ShapesError(argparse.ArgumentTypeError, ValueError):
    """argparse prints an ArgumentTypeError's message (a plain ValueError's it hides)."""


def parse_shapes(text):
    """--shapes' "op:AxBxC,..." as SHAPES' (op, shape) pairs; the last dimension is a row's width."""
    ops = {op for op, _ in SHAPES}
    shapes = []
    for item in text.split(","):
        op, sep, dims = item.strip().partition(":")
        if op not in ops or not sep:
            raise ShapesError(f"{item!r} is not op:AxB... with op one of {', '.join(sorted(ops))}")
        try:
            shape = tuple(int(d) for d in dims.split("x"))
        except ValueError:
            shape = ()
        if len(shape) < 2 or min(shape) < 1:
            raise ShapesError(f"{item!r}: rows x width (or more dimensions), positive integers joined by x")
        if op in MODULATED and len(shape) != 3:
            raise ShapesError(f"{item!r}: {op} takes batch x tokens x width (a modulation an entry)")
        shapes.append((op, shape))
    return shapes


def quantize(y):
    """The per-row quantizer in PyTorch (torchao's per-row math): fp32 in, (q, scales)."""
    scale = y.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (y / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def torch_impl(op):
    """The PyTorch code for the op's (q, scales) (and the gated residual's sum)."""
    if op == "quantize_fp8":
        return lambda x: quantize(x.float())
    if op == "rms_norm_fp8":
        return lambda x, w: quantize(torch.nn.functional.rms_norm(x.float(), x.shape[-1:], w.float(), 1e-6))
    if op == "gelu_fp8":
        return lambda x: quantize(torch.nn.functional.gelu(x.float(), approximate="tanh"))

    def adaln(x, scale, shift):
        n = torch.nn.functional.rms_norm(x.float(), x.shape[-1:], None, 1e-6)
        return quantize(n * (1 + scale.float()) + shift.float())
    if op == "adaln_fp8":
        return adaln

    def gated_residual_adaln(residual, x, gate, scale, shift):
        h = (residual.float() + x.float() * gate.float()).to(x.dtype)
        return (h, *adaln(h, scale, shift))
    return gated_residual_adaln


def ltx_impl(ltx, op):
    if op == "adaln_fp8":
        return lambda x, sc, sh: ltx.adaln_fp8(x, sc, sh, 1e-6, norm="rms")
    if op == "gated_residual_adaln_fp8":
        return lambda r, x, g, sc, sh: ltx.gated_residual_adaln_fp8(r, x, g, sc, sh, 1e-6, norm="rms")
    if op == "gelu_fp8":
        return lambda x: ltx.gelu_fp8(x, "tanh")
    return getattr(ltx, op)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="timings per implementation (alternating order)")
    parser.add_argument("--skip-gemms", action="store_true", help="only the producers")
    parser.add_argument("--ours-only", action="store_true",
                        help="time ltx's producers alone (no PyTorch peers): two builds' A/B, each in its own tree")
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES,
                        help="the producers' shapes instead of the LTX ones, e.g. adaln_fp8:2x2688x2048,gelu_fp8:5376x8192")
    args = parser.parse_args()
    if torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("FP8 needs a GPU of compute capability 8.9 or newer")
    from kernels import get_local_kernel

    ltx = get_local_kernel(REPO)
    bench_ops.configure_dynamo()  # a compile peer past dynamo's recompile limit raises, never runs eagerly
    bandwidth = harness.copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth:.0f} GB/s")
    for op, shape in args.shapes:
        d = shape[-1]

        def inputs():
            x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            if op in ("quantize_fp8", "gelu_fp8"):
                return (x,)
            if op == "rms_norm_fp8":
                return x, 1 + 0.1 * torch.randn(d, device="cuda", dtype=torch.bfloat16)
            mod = [0.1 * torch.randn(shape[0], 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            if op == "adaln_fp8":
                return x, *mod[:2]
            return torch.randn_like(x), x, *mod  # gated_residual_adaln_fp8

        first = inputs()
        elements = first[0].numel()
        rows = elements // d
        # 2 bytes in, 1 out an element, a scale a row; the gated residual reads two rows and
        # writes its sum
        per_element = 7 if op == "gated_residual_adaln_fp8" else 3
        nbytes = per_element * elements + 4 * rows
        input_bytes = (4 if op == "gated_residual_adaln_fp8" else 2) * elements
        sets = [first] + [inputs() for _ in range(harness.copies_for_cold_l2(input_bytes) - 1)]
        ours = ltx_impl(ltx, op)
        eager = torch_impl(op)
        compiled = bench_ops.compiled(eager, "inductor")
        impls = [("compile", lambda t, f=compiled: (lambda: f(*t))), ("eager", lambda t, f=eager: (lambda: f(*t))),
                 ("ltx", lambda t: (lambda: ours(*t)))]
        if args.ours_only:
            impls = impls[2:]
        q, s = ours(*first)[-2:]
        notes = {}
        for name, factory in impls[:-1]:
            pq, ps = factory(first)()[-2:]
            same = torch.equal(pq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ps, s)
            notes[name] = "  same bits as ltx" if same else \
                f"  differs from ltx: {(pq.view(torch.uint8) != q.view(torch.uint8)).float().mean().item():.2e} of q"
        notes["ltx"] = f"  host {harness.host_time_us(lambda: ours(*first)):.1f} us a call"
        print(f"\n{op} {list(shape)} bf16, {nbytes / 1e6:.1f} MB")
        harness.time_and_print(impls, sets, nbytes, bandwidth, args.reps, {}, peer="compile", notes=notes)
    if not args.skip_gemms:
        gemms(ltx, args.reps)


def gemms(ltx, reps):
    """bf16 against FP8 at the GEMMS shapes; the % column is of the copy bandwidth, not
    meaningful for these compute-bound calls: read the microseconds and the ratio."""
    for m, n, k in GEMMS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        linear = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        layer = ltx.FP8Linear(linear)
        qx, sx = ltx.quantize_fp8(x)

        def scaled(fast):
            return lambda t: (lambda: torch._scaled_mm(qx, layer.weight_fp8.t(), scale_a=sx, scale_b=layer.weight_scale,
                                                       bias=layer.bias, out_dtype=torch.bfloat16, use_fast_accum=fast))
        impls = [("bf16", lambda t: (lambda: torch.nn.functional.linear(x, linear.weight, linear.bias))),
                 ("fp8", scaled(False)), ("fp8 fast", scaled(True)),
                 ("FP8Linear", lambda t: (lambda: layer(x)))]
        with torch.no_grad():
            want = linear(x).float()
            notes, skipped = {}, {}
            for name, factory in impls[1:]:
                try:
                    got = factory(None)().float()
                except RuntimeError as error:  # a GEMM this torch / GPU does not take
                    skipped[name] = str(error).splitlines()[0][:160]
                    continue
                notes[name] = f"  L2 {((got - want).norm() / want.norm()).item():.2%} from bf16"
            # Eager FP8 forwards are host-bound: each call's host time beside its kernel time.
            for name, factory in impls:
                if name not in skipped:
                    notes[name] = notes.get(name, "") + f"  host {harness.host_time_us(factory(None)):.1f} us a call"
            print(f"\nGEMM {m}x{n}x{k} (M x N x K)")
            harness.time_and_print(impls, [None], 2 * (m * k + n * k + m * n), 1e9, reps, skipped, peer="bf16", notes=notes)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8.py needs a CUDA GPU")
    main()
