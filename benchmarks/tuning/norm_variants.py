"""Candidate launches of RMSNorm rows (norm_variants.cu), plain or after a residual add
(fused_add_rms_norm), against the production launch and torch.compile of the reference (the
fastest peer at the fp32 model-shape rows; Liger too for the residual rows), on a CUDA GPU,
in one process: kernel time by CUDA-graph replay with inputs rotated past L2 (harness.py),
alternating the order between rounds, % of the copy bandwidth measured in the same run,
and each variant's max error against fp64 next to production's.

    python -m benchmarks.tuning.norm_variants [--variants 0/0,2/512,4/512] [--shapes fp32|all]
    python -m benchmarks.tuning.norm_variants --shapes residual --variants 0/0,2/0,4/2/0

A variant is CACHED/BLOCK or CACHED/PER_THREAD/BLOCK: 16-byte vectors a thread of
`norm_kernel` holds (0: the package's launch), the vectors a thread the row's threads are
counted for (default CACHED) and the threads of a block that rows share (0: a block a row). The .cu is built with
nvcc against this python's torch into .build-cache/norm_variants (sm of the GPU only) and
loaded as a torch op library. Tune a launch here, then port the winner into
norm_forward.cuh's `launch` and confirm it with bench_ops.py on the package build.
"""

import argparse
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.ops import bench_ops
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
                       for d in (4096, 5120, 6144, 7168, 8192)]}
SMALL_SETS = 192  # rotated input sets at most (as the sweep): decode rows would want thousands


def reference(ltx, weighted):
    """The eager code bench_ops times: diffusers' weightless norm, or Llama's weighted one."""
    return ltx.reference.llama_rms_norm if weighted else ltx.reference.diffusers_rms_norm


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="0/0,2/0,2/512,2/1024,4/0,4/256,4/512,4/1024,1/0,1/256")
    parser.add_argument("--shapes", choices=["fp32", "bf16", "residual", "all"], default="fp32")
    parser.add_argument("--reps", type=int, default=2, help="timings per variant (alternating order)")
    args = parser.parse_args()
    load(SOURCE)
    run, run_residual = torch.ops.norm_variants.run, torch.ops.norm_variants.run_residual
    from kernels import get_local_kernel

    ltx = get_local_kernel(REPO)  # for its reference module
    bandwidth = harness.copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth:.0f} GB/s")
    residual_rows = args.shapes == "residual"
    liger = bench_ops.load_libraries(on_cuda=True).attr("liger", "LigerFusedAddRMSNormFunction")

    def variant(spec):
        cached, *launch = (int(v) for v in spec.split("/"))
        per_thread, block = launch if len(launch) == 2 else (0, launch[0])

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

    def fused_add(x, r, w):
        h = x + r  # returned, as the op stores it: a compiled peer must write it too
        return reference(ltx, True)(h, w), h

    def compiled(weighted):
        fn = torch.compile(fused_add if residual_rows else reference(ltx, weighted), dynamic=False)
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
        copies = harness.copies_for_cold_l2(nbytes // 2, cap=SMALL_SETS)
        sets = [first] + [inputs() for _ in range(copies - 1)]
        if residual_rows:
            expected = fused_add(*[t.double() for t in first])[0]
        else:
            expected = reference(ltx, weighted)(*[t.double() for t in first if t is not None])
        impls = [("compile", compiled(weighted))]
        impls += [(spec, variant(spec)) for spec in args.variants.split(",")]
        if residual_rows and liger is not None:  # last: it may write its sum into the residual
            impls.append(("liger", lambda inputs: (lambda: liger.apply(*inputs, 1e-6, 0.0, "llama"))))
        print(f"\n{rows}x{d} {str(dtype)[6:]}{'' if weighted else ' no weight'}"
              f"{' after a residual add' if residual_rows else ''}, {nbytes / 1e6:.3f} MB, {len(sets)} sets")
        errors, skipped = {}, {}
        for name, factory in impls:
            try:
                got = factory(first)()
                got = got[0] if isinstance(got, tuple) else got  # (y, h) of the residual rows' peers
                errors[name] = (got.double() - expected).abs().max().item()
            except RuntimeError as error:
                skipped[name] = str(error).splitlines()[0]
        # A variant that computes something else (over 4x production's error) is not timed.
        limit = 4 * errors["0/0"] + 1e-6 if "0/0" in errors else float("inf")
        for name, err in errors.items():
            if name != "compile" and err > limit:
                skipped[name] = f"WRONG RESULT (max error {err:.1e}, production's {errors['0/0']:.1e})"
        notes = {name: f"  err {err:.1e}" for name, err in errors.items()}
        harness.time_and_print(impls, sets, nbytes, bandwidth, args.reps, skipped, peer="compile", notes=notes)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("norm_variants.py needs a CUDA GPU")
    main()
