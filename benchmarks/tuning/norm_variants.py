"""Candidate launches of RMSNorm rows (norm_variants.cu), plain or after a residual add
(fused_add_rms_norm), against the production launch and torch.compile of the reference (the
fastest peer at the fp32 model-shape rows; Liger too for the residual rows), on a CUDA GPU,
in one process: kernel time by CUDA-graph replay with inputs rotated past L2 (harness.py),
alternating the order between rounds, % of the copy bandwidth measured in the same run,
and each variant's max error against fp64 next to production's.

    python -m benchmarks.tuning.norm_variants [--variants 0/0,2/512,4/512] [--shapes fp32|all]
    python -m benchmarks.tuning.norm_variants --shapes residual --variants 0/0,2/0,4/2/0
    python -m benchmarks.tuning.norm_variants --shapes fp8 [--variants 0/0,2/0,4/256]

A variant is CACHED/BLOCK or CACHED/PER_THREAD/BLOCK: 16-byte vectors a thread of
`norm_kernel` holds (0: the package's launch), the vectors a thread the row's threads are
counted for (default CACHED) and the threads of a block that rows share (0: a block a row).
16-bit rows also take lP.B: the lean kernel (norm_lean_kernel) at P vectors a thread (1, 2
or 4), rows sharing blocks of B threads (at one vector a thread, rows of a warp or less; 0: a
block a row); plain rows pB: the plain row kernel (two vectors a thread) on a block of B
threads a row; weighted RMSNorm rows of a warp or less mR.B: R rows a lane group (their
loads in flight together, the weight loaded once), blocks of B threads. The .cu
is built with nvcc against this python's torch into .build-cache/norm_variants (sm of the
GPU only) and loaded as a torch op library. Tune a launch here, then port the winner into
norm_forward.cuh's `launch` and confirm it with bench_ops.py on the package build.

`--shapes lean` times each op of the norm family (RMSNorm with a weight, fused add + RMSNorm,
AdaLN RMS and LayerNorm, the gated residual's AdaLN; bf16) on decode rows and rows of 256-512
elements (`--shapes narrow`: rows of 128 and 256 elements, 1024 to 65536 of them), against compile (and Liger where it has the op): production (0/0), norm_kernel's
launches and the lean kernel's, lP.B: P vectors a thread, rows sharing blocks of B threads
(0: a block a row).

`--shapes fp32-decode` times AdaLN's fp32 decode rows past 2048 vectors (1x16384, 1x8192,
8x16384; the four AdaLN ops, `--ops` to choose) the same way: production, norm_kernel at
four vectors a thread over 512 threads (the tail re-read) and at eight (`8/0/0`: the row
held in registers, production's launch).

`--shapes fp8` (compute capability 8.9 or newer) times rms_norm_fp8's rows (FP8 out, an fp32
scale a row; its argument layout, the fp32 weight, is the package op's) at the model shapes,
beside the package's op as users call it, torch.compile of the PyTorch code (bench_fp8's) and
quantize_fp8 of the same input (a bandwidth yardstick); each variant's (q, scales) against
the production launch's: the share of q's bytes that differ and the scales' largest relative
difference (another summation order may move y by an ulp and flip a rare rounding; over
MAX_Q_DIFFER or MAX_SCALE_DIFFER it is marked and not timed).
"""

import argparse
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.ops import bench_fp8, bench_ops
from benchmarks.tuning.variants_build import load

REPO = Path(__file__).resolve().parents[2]

SOURCE = Path(__file__).with_name("norm_variants.cu")
# (rows, D, dtype, weighted): the model-shape rows where compile is the peer to beat, and the
# neighbours a launch change for them would move.
SHAPES = {"fp32": [(5376, 2048, torch.float32, False), (8192, 4096, torch.float32, True),
                   (1024, 2048, torch.float32, True), (4096, 4096, torch.float32, True),
                   (32768, 4096, torch.float32, True)],
          "bf16": [(5376, 2048, torch.bfloat16, False), (8192, 4096, torch.bfloat16, True),
                   (32768, 4096, torch.bfloat16, True), (4096, 4096, torch.bfloat16, True)],
          # fused_add_rms_norm (weighted, Llama's order): decode steps and prefill batches
          # over the LLM widths where compile's fused add + norm is the peer to beat.
          "residual": [(rows, d, torch.bfloat16, True) for rows in (1, 8192)
                       for d in (4096, 5120, 6144, 7168, 8192)],
          # the size sweep's missed cells off the model shapes: one row, rows just under two
          # an SM (256), rows of 256 elements; plain and after a residual add
          "gaps": [(rows, d, torch.bfloat16, True) for rows, d in
                   ((1, 256), (1, 2048), (1, 4096), (256, 2048), (256, 4096), (4096, 256), (4096, 512))],
          "residual-gaps": [(rows, d, torch.bfloat16, True) for rows, d in
                            ((1, 256), (1, 2560), (1, 4096), (1, 8192), (1, 16384), (64, 4096), (256, 4096),
                             (256, 9728), (4096, 256), (4096, 2560), (8192, 4096), (8192, 8192))],
          # the lean kernel's rows: decode steps, and rows of 256-512 elements at any batch
          "lean": [(rows, d, torch.bfloat16, True) for rows, d in
                   ((1, 256), (1, 2048), (1, 4096), (1, 16384), (256, 2048), (4096, 256), (4096, 512),
                    (65536, 256), (16384, 512))],
          # AdaLN's fp32 decode rows past 2048 vectors (four a thread of 512 re-read the tail)
          "fp32-decode": [(rows, d, torch.float32, True) for rows, d in ((1, 16384), (1, 8192), (8, 16384))],
          # rows of 128 and 256 elements at batches from 1024 to 65536 (the lean set's ops)
          "narrow": [(rows, d, torch.bfloat16, True) for d in (128, 256) for rows in (1024, 4096, 16384, 65536)],
          # rms_norm_fp8: LTX-Video's tokens (batch 2 at 49 frames; diffusers' norm has no
          # weight), its 2 x 2688 tokens, and LLM prefills
          "fp8": [(2 * 21504, 2048, torch.bfloat16, False), (2 * 21504, 2048, torch.bfloat16, True),
                  (8192, 4096, torch.bfloat16, True), (5376, 2048, torch.bfloat16, True),
                  (32768, 4096, torch.bfloat16, True)]}
SMALL_SETS = 192  # rotated input sets at most (as the sweep): decode rows would want thousands
MAX_CALLS = 512  # calls a graph holds at most (as the sweep)
EPS = 1e-6
DEFAULT_VARIANTS = "0/0,2/0,2/512,2/1024,4/0,4/256,4/512,4/1024,1/0,1/256"
# FP8 rows: production runs D = 2048 (bf16) at four vectors a thread, a 64-thread block a row;
# D = 4096 below 64 rows an SM in the two-vector row kernel (256 threads a row), above at four
# (128). Against it, wider rows (two or one vectors a thread) and rows sharing blocks; rows
# of 32 threads or fewer (4/8/...) share blocks of 128 whatever the block asked.
# The lean kernel's layouts beside production and norm_kernel's two- and four-vector launches.
LEAN_VARIANTS = "0/0,2/0,4/0,l1.0,l2.0,l4.0,l1.128"
FP32_DECODE_VARIANTS = "0/0,4/1/512,8/0/0"
FP32_DECODE_OPS = ("adaln_rms", "adaln_layer", "gated_residual_adaln_rms", "gated_residual_adaln_layer")
LEAN_OPS = ("rms_norm", "fused_add_rms_norm", "adaln_rms", "adaln_layer", "gated_residual_adaln_rms",
            "gated_residual_adaln_layer")
FP8_VARIANTS = "0/0,2/0,2/256,2/512,4/0,4/128,4/256,4/512,1/0,4/8/0"
# A variant's FP8 rows against production's: an ulp of y flips a rounding now and then, a
# different kernel order more often than that.
MAX_Q_DIFFER, MAX_SCALE_DIFFER = 1e-3, 1e-6


def reference(ltx, weighted):
    """The eager code bench_ops times: diffusers' weightless norm, or Llama's weighted one."""
    return ltx.reference.llama_rms_norm if weighted else ltx.reference.diffusers_rms_norm


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", help=f"default {DEFAULT_VARIANTS}; with --shapes fp8 {FP8_VARIANTS}")
    parser.add_argument("--shapes", choices=["fp32", "bf16", "residual", "gaps", "residual-gaps", "lean", "narrow", "fp32-decode", "fp8",
                                 "all"],
                        default="fp32")
    parser.add_argument("--ops", help="--shapes lean, narrow or fp32-decode: comma-separated, of "
                        f"{','.join(LEAN_OPS)} (default: all; fp32-decode: the AdaLN ops)")
    parser.add_argument("--reps", type=int, default=2, help="timings per variant (alternating order)")
    args = parser.parse_args()
    load(SOURCE)
    bench_ops.configure_dynamo()  # a shape past dynamo's recompile limit would time eager code as compile's
    run, run_residual = torch.ops.norm_variants.run, torch.ops.norm_variants.run_residual
    from kernels import get_local_kernel

    ltx = get_local_kernel(REPO)  # for its reference module
    if args.shapes == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("--shapes fp8 needs a GPU of compute capability 8.9 or newer")
    bandwidth = harness.copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth:.0f} GB/s")
    if args.shapes == "fp8":
        return fp8_rows(ltx, (args.variants or FP8_VARIANTS).split(","), bandwidth, args.reps)
    if args.shapes in ("lean", "narrow"):
        ops = args.ops.split(",") if args.ops else LEAN_OPS
        return lean_rows(ltx, ops, SHAPES[args.shapes], (args.variants or LEAN_VARIANTS).split(","), bandwidth,
                         args.reps)
    if args.shapes == "fp32-decode":
        ops = args.ops.split(",") if args.ops else FP32_DECODE_OPS
        return lean_rows(ltx, ops, SHAPES[args.shapes], (args.variants or FP32_DECODE_VARIANTS).split(","),
                         bandwidth, args.reps)
    variants = (args.variants or DEFAULT_VARIANTS).split(",")
    residual_rows = args.shapes in ("residual", "residual-gaps")
    liger = bench_ops.load_libraries(on_cuda=True).attr("liger", "LigerFusedAddRMSNormFunction")

    def variant(spec):
        cached, per_thread, block = parse_variant(spec)

        def factory(inputs):
            # cast_before_weight: the Llama order, as bench_ops calls the weighted rows
            if residual_rows:
                x, r, w = inputs
                out, r_out = torch.empty_like(x), torch.empty_like(x)
                return lambda: (run_residual(x, r, w, out, r_out, 1e-6, True, cached, per_thread, block), out)[1]
            x, w = inputs
            out = torch.empty_like(x)
            return lambda: (run(x, w, out, 1e-6, w is not None, cached, per_thread, block), out)[1]
        return factory

    fused_add = fused_add_eager(ltx)

    def compiled(weighted):
        fn = bench_ops.compiled(fused_add if residual_rows else reference(ltx, weighted), "inductor")
        return lambda inputs: (lambda: fn(*[t for t in inputs if t is not None]))

    shapes = SHAPES["fp32"] + SHAPES["bf16"] if args.shapes == "all" else SHAPES[args.shapes]
    for rows, d, dtype, weighted in shapes:
        def inputs():
            x = torch.randn(rows, d, device="cuda", dtype=dtype)
            w = (1 + 0.1 * torch.randn(d, device="cuda", dtype=dtype)) if weighted else None
            return (x, torch.randn_like(x), w) if residual_rows else (x, w)

        first = inputs()
        row_bytes = first[0].numel() * first[0].element_size()
        # in and out (the residual's two more), and the weight
        nbytes = (4 if residual_rows else 2) * row_bytes + (d * first[0].element_size() if weighted else 0)
        copies = harness.copies_for_cold_l2(input_bytes(first), cap=SMALL_SETS)
        sets = [first] + [inputs() for _ in range(copies - 1)]
        if residual_rows:
            expected = fused_add(*[t.double() for t in first])[:1]  # y: a variant's h is the same sum
        else:
            expected = reference(ltx, weighted)(*[t.double() for t in first if t is not None])
        impls = [("compile", compiled(weighted))]
        impls += [(spec, variant(spec)) for spec in variants]
        if residual_rows and liger is not None:  # last: it may write its sum into the residual
            impls.append(("liger", lambda inputs: (lambda: liger.apply(*inputs, 1e-6, 0.0, "llama"))))
        print(f"\n{rows}x{d} {str(dtype)[6:]}{'' if weighted else ' no weight'}"
              f"{' after a residual add' if residual_rows else ''}, {nbytes / 1e6:.3f} MB, {len(sets)} sets")
        notes, skipped = check_outputs(impls, first, expected)
        harness.time_and_print(impls, sets, nbytes, bandwidth, args.reps, skipped, peer="compile", notes=notes,
                               max_calls=MAX_CALLS)


LEAN, MULTI_ROW = 100, 101  # norm_variants.cu's kLean, kMultiRow


def parse_variant(spec):
    """CACHED/BLOCK or CACHED/PER_THREAD/BLOCK as (cached, per_thread, block); pB (plain
    rows): the row kernel on B threads, as (-B, 0, 0); lP.B: the lean kernel at P vectors a
    thread, rows sharing blocks of B threads (0: a block a row), as (LEAN, P, B); mR.B: R rows
    a lane group in blocks of B threads (weighted RMSNorm rows of a warp or less), as
    (MULTI_ROW, R, B)."""
    if spec[0] in "lm":
        per, block = spec[1:].split(".")
        return LEAN if spec[0] == "l" else MULTI_ROW, int(per), int(block)
    if spec[0] == "p":
        return -int(spec[1:]), 0, 0
    cached, *launch = (int(v) for v in spec.split("/"))
    per_thread, block = launch if len(launch) == 2 else (0, launch[0])
    return cached, per_thread, block


def lean_rows(ltx, ops, shapes, variants, bandwidth, reps):
    """The --shapes lean, narrow or fp32-decode rows, `shapes`: each op in the shape's dtype at each launch in
    `variants`, against compile
    of the PyTorch code (ltx.reference's; the Llama order for the weighted norms) and Liger's
    RMSNorm and fused add + RMSNorm. A variant's output (each output) is compared with
    production's: over 4x its max error against fp64 it is marked and not timed."""
    ref, v = ltx.reference, torch.ops.norm_variants
    libraries = bench_ops.load_libraries(on_cuda=True)
    liger = {"rms_norm": libraries.attr("liger", "LigerRMSNormFunction"),
             "fused_add_rms_norm": libraries.attr("liger", "LigerFusedAddRMSNormFunction")}

    for op in ops:
        norm = op.rsplit("_", 1)[1]
        eager = {"rms_norm": ref.llama_rms_norm, "fused_add_rms_norm": fused_add_eager(ltx)}.get(op)
        if eager is None:
            eager = ref.gated_residual_adaln(norm) if op.startswith("gated") else ref.adaln(norm)

        # A shape that runs L2-resident (harness.l2_resident) gives every call of a variant one
        # pair of output buffers, as the sweep's graphs reuse theirs; otherwise each call has
        # its own.
        shared = {}

        def variant(spec, op=op, norm=norm, shared=shared):
            cached, per_thread, block = parse_variant(spec)
            launch = (cached, per_thread, block)

            def factory(t):
                out, h = shared.get("outputs") or (torch.empty_like(t[0]), torch.empty_like(t[0]))
                if op == "rms_norm":
                    return lambda: (v.run(t[0], t[1], out, EPS, True, *launch), out)[1]
                if op == "fused_add_rms_norm":
                    return lambda: (v.run_residual(t[0], t[1], t[2], out, h, EPS, True, *launch), (out, h))[1]
                if op.startswith("adaln"):
                    return lambda: (v.run_adaln(t[0], t[1], t[2], out, EPS, norm, *launch), out)[1]
                return lambda: (v.run_gated_adaln(*t, h, out, EPS, norm, *launch), (h, out))[1]
            return factory

        for rows, d, dtype, _ in shapes:
            shared.clear()

            def inputs():
                x = torch.randn(rows, d, device="cuda", dtype=dtype)
                if op == "rms_norm":
                    return x, 1 + 0.1 * torch.randn(d, device="cuda", dtype=dtype)
                if op == "fused_add_rms_norm":
                    return x, torch.randn_like(x), 1 + 0.1 * torch.randn(d, device="cuda", dtype=dtype)
                mod = [0.3 * torch.randn(rows, d, device="cuda", dtype=dtype) for _ in range(2)]  # per token
                if op.startswith("adaln"):
                    return (x, *mod)
                return (torch.randn_like(x), x, torch.randn(d, device="cuda", dtype=dtype), *mod)

            first = inputs()
            # every operand read once, the outputs written (the residual ops' sum too)
            outputs = 2 if op.startswith(("fused", "gated")) else 1
            out_bytes = first[0].numel() * first[0].element_size()
            nbytes = sum(t.numel() * t.element_size() for t in first) + outputs * out_bytes
            copies = harness.copies_for_cold_l2(input_bytes(first), cap=SMALL_SETS)
            sets = [first] + [inputs() for _ in range(copies - 1)]
            compiled = bench_ops.compiled(eager, "inductor")  # a graph per shape, checked compiled
            impls = [("compile", lambda t: (lambda: compiled(*t)))]
            impls += [(spec, variant(spec)) for spec in variants]
            if liger.get(op) is not None:
                fn = liger[op]
                if op == "rms_norm":
                    impls.append(("liger", lambda t: (lambda: fn.apply(t[0], t[1], EPS))))
                else:  # last: it may write its sum into the residual
                    impls.append(("liger", lambda t: (lambda: fn.apply(*t, EPS, 0.0, "llama"))))
            expected = eager(*[t.double() for t in first])
            # Liger's fused add may write its sum into the residual: not run ahead of the timing
            notes, skipped = check_outputs([i for i in impls if i[0] != "liger"], first, expected)
            if harness.l2_resident(len(sets), input_bytes(first)):
                shared["outputs"] = (torch.empty_like(first[0]), torch.empty_like(first[0]))
            print(f"\n{op} {rows}x{d} {str(dtype).removeprefix('torch.')}, {nbytes / 1e6:.3f} MB, {len(sets)} sets")
            harness.time_and_print(impls, sets, nbytes, bandwidth, reps, skipped, peer="compile", notes=notes,
                                   max_calls=MAX_CALLS)


def input_bytes(inputs):
    """The bytes of an input set, as time_and_print counts them for its L2 regime."""
    return sum(t.numel() * t.element_size() for t in inputs if torch.is_tensor(t))


def fused_add_eager(ltx):
    """The residual add and Llama's norm, as bench_ops times them: (y, h)."""
    def run(x, r, w):
        h = x + r  # returned, as the op stores it: a compiled peer must write it too
        return ltx.reference.llama_rms_norm(h, w), h
    return run


def check_outputs(impls, first, expected):
    """Runs each (name, factory) of `impls` on the inputs `first` and compares its outputs with
    `expected` (fp64; a tuple compares the outputs in order, as many as it has). Returns the
    notes (each one's max error) and the skipped (name -> why): those that raised
    (CompileFellBack too: a compile peer run eagerly) and, a variant that computes something
    else, those over 4x production's (0/0) error."""
    expected = expected if isinstance(expected, tuple) else (expected,)
    errors, skipped = {}, {}
    for name, factory in impls:
        try:
            got = factory(first)()
            got = got if isinstance(got, tuple) else (got,)
            errors[name] = max((g.double() - e).abs().max().item() for g, e in zip(got, expected))
        except RuntimeError as error:
            skipped[name] = str(error).splitlines()[0][:100]
    limit = 4 * errors["0/0"] + 1e-6 if "0/0" in errors else float("inf")
    for name, err in errors.items():
        if name != "compile" and err > limit:
            skipped[name] = f"WRONG RESULT (max error {err:.1e}, production's {errors['0/0']:.1e})"
    return {name: f"  err {err:.1e}" for name, err in errors.items()}, skipped


def fp8_reference(x, w):
    """rms_norm_fp8 in PyTorch, as bench_fp8 writes it: the norm in fp32, then the per-row
    quantizer."""
    w = None if w is None else w.float()
    return bench_fp8.quantize(torch.nn.functional.rms_norm(x.float(), x.shape[-1:], w, EPS))


def fp8_rows(ltx, variants, bandwidth, reps):
    """The --shapes fp8 rows: rms_norm_fp8 (cast_before_weight off, its default and
    bench_fp8's) at each launch in `variants`, against production's launch (0/0), the
    package's op, compile and quantize_fp8."""
    run_fp8 = torch.ops.norm_variants.run_fp8
    compiled = bench_ops.compiled(fp8_reference, "inductor")

    def variant(spec):
        cached, per_thread, block = parse_variant(spec)
        # the fp32 weight: the op's arguments, without its conversion kernel in every call
        return lambda inputs: (lambda: run_fp8(inputs[0], inputs[2], EPS, False, cached, per_thread, block))

    for rows, d, dtype, weighted in SHAPES["fp8"]:
        def inputs():
            x = torch.randn(rows, d, device="cuda", dtype=dtype)
            w = (1 + 0.1 * torch.randn(d, device="cuda", dtype=dtype)) if weighted else None
            # what rms_norm_fp8 makes of w every call (ones without one: the same arguments)
            w32 = w.float() if weighted else torch.ones(d, device="cuda")
            return x, w, w32

        first = inputs()
        x_bytes = first[0].numel() * first[0].element_size()
        # 16-bit rows in, a byte an element and an fp32 scale a row out, the fp32 weight read
        nbytes = x_bytes + first[0].numel() + 4 * rows + 4 * d
        sets = [first] + [inputs() for _ in range(harness.copies_for_cold_l2(x_bytes, cap=SMALL_SETS) - 1)]
        impls = [("compile", lambda t: (lambda: compiled(t[0], t[1])))]
        impls += [(spec, variant(spec)) for spec in variants]
        if hasattr(ltx, "rms_norm_fp8"):  # the op as users call it (bench_fp8's): w converted in it
            impls.append(("ltx op", lambda t: (lambda: ltx.rms_norm_fp8(t[0], t[1], EPS))))
        if hasattr(ltx, "quantize_fp8"):
            impls.append(("quantize", lambda t: (lambda: ltx.quantize_fp8(t[0]))))
        print(f"\nrms_norm_fp8 {rows}x{d} {str(dtype)[6:]}{'' if weighted else ' no weight'}, "
              f"{nbytes / 1e6:.3f} MB, {len(sets)} sets")
        q0, s0 = variant("0/0")(first)()
        q0 = q0.view(torch.uint8)
        notes, skipped = {"quantize": "  (x alone: the yardstick)"}, {}
        for name, factory in impls:
            if name == "quantize":
                continue
            try:
                q, s = factory(first)()
            except RuntimeError as error:
                skipped[name] = str(error).splitlines()[0]
                continue
            differ = torch.count_nonzero(q.view(torch.uint8) != q0).item() / q0.numel()
            ratio = (s.double() / s0.double() - 1).abs().max().item()  # NaN (marked) where a row's is
            if differ == 0 and torch.equal(s, s0):
                notes[name] = "  same bits as 0/0"
            else:
                notes[name] = f"  vs 0/0: q {differ:.1e} of bytes differ, scales {ratio:.1e} relative"
            if name in variants and not (differ <= MAX_Q_DIFFER and ratio <= MAX_SCALE_DIFFER):
                skipped[name] = f"DIFFERS FROM 0/0 (q {differ:.1e} of bytes, scales {ratio:.1e} relative)"
        del q0, s0
        peer = "0/0" if "0/0" in variants and "0/0" not in skipped else "compile"
        harness.time_and_print(impls, sets, nbytes, bandwidth, reps, skipped, peer=peer, notes=notes)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("norm_variants.py needs a CUDA GPU")
    main()
