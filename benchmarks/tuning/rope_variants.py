"""Candidate RoPE launches (rope_variants.cu) against the production launch and the fastest
peer, on a CUDA GPU, in one process: kernel time by CUDA-graph replay with inputs rotated
past L2 (harness.py), % of the copy bandwidth measured in the same run, and each variant's
output checked bit-equal to the production kernel's first. Rotate-half shapes run against
Liger-Kernel (HALF_TABLE variants too: the tables' halves are equal here, as in
transformers'); `--shapes interleaved` runs LTX-Video's [1, S, C] q and k with fp32 tables
against torch.compile of the diffusers code.

    python -m benchmarks.tuning.rope_variants [--variants 0/1,3/1,3/4] [--shapes big|small|decode|sweep|all]
    python -m benchmarks.tuning.rope_variants --shapes interleaved [--variants 0/0,11/0,10/64]

A rotate-half variant is NUMBER/HEAD_BLOCKS (blocks a token's heads are spread over), an
interleaved one NUMBER/UNIT_THREADS (10: the pairs kernel, a head's units over blocks of that
many threads). The .cu is built with nvcc against this python's torch into
.build-cache/rope_variants (about 30 s, sm of the GPU only) and loaded as a torch op library.
Tune a launch here, then port the winner into rope_rotate.cuh and confirm it with
bench_ops.py on the package build.
"""

import argparse
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.ops import bench_ops
from benchmarks.tuning.variants_build import load

REPO = Path(__file__).resolve().parents[2]

SOURCE = Path(__file__).with_name("rope_variants.cu")
NAMES = {0: "production", 1: "4 heads, 160 threads", 2: "4 heads, left half of the tables",
         3: "2 heads, 320 threads", 4: "2 heads, 320 threads, 64 regs", 5: "4 heads, 2 tokens a block",
         6: "1 head, 8-byte units", 7: "1 head, 16-byte units", 8: "2 heads, 16-byte units",
         9: "production's kernel", 10: "pairs kernel", 11: "rope_kernel, two heads"}
SHAPES = {"big": [(1, 32, 8, 8192, 128, torch.bfloat16), (4, 32, 8, 4096, 128, torch.bfloat16),
                  (1, 32, 8, 8192, 128, torch.float16)],
          "small": [(1, 32, 8, 128, 128, torch.bfloat16), (1, 32, 8, 1, 128, torch.bfloat16),
                    (1, 32, 8, 1024, 128, torch.bfloat16), (1, 32, 32, 16, 128, torch.bfloat16)],
          # a decode step: one token of each of a few sequences (Llama-8B's heads)
          "decode": [(b, 32, 8, 1, 128, torch.bfloat16) for b in (1, 2, 4, 8)],
          # the size sweep's missed cells past decode: odd head counts, three heads, 256 tokens
          "sweep": [(1, 76, 19, 8192, 128, torch.float16), (1, 20, 5, 4096, 128, torch.bfloat16),
                    (1, 32, 8, 256, 128, torch.bfloat16), (1, 2, 1, 4096, 128, torch.bfloat16)]}
# LTX-Video's q and k of one sequence: (tokens, channels), from a decode step to the 2B
# model's 49 frames at batch 2 (as one sequence of 10752 tokens)
INTERLEAVED_SHAPES = [(1, 256), (1, 2048), (1, 16384), (8, 2048), (256, 2048), (4096, 256), (10752, 2048)]
INTERLEAVED_VARIANTS = "0/0,11/0,10/256,10/128,10/64,10/32"
SMALL_SETS = 192  # rotated input sets at most (as the sweep): decode inputs would want thousands
MAX_CALLS = 512  # calls a graph holds at most (as the sweep)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", help="default: 0/1,1/1,2/1,3/1,3/4,4/1,5/1,6/4,7/4,8/1 (rotate-half), "
                        f"{INTERLEAVED_VARIANTS} (interleaved)")
    parser.add_argument("--shapes", choices=["big", "small", "decode", "sweep", "all", "interleaved"], default="all")
    parser.add_argument("--reps", type=int, default=2, help="timings per variant (alternating order)")
    parser.add_argument("--in-place", action="store_true",
                        help="our variants write into q and k (as Liger does): no output footprint of their own")
    args = parser.parse_args()
    load(SOURCE)
    if args.shapes == "interleaved":
        if args.in_place:
            raise SystemExit("rope_variants: --in-place is for the rotate-half shapes")
        return main_interleaved(args)
    args.variants = args.variants or "0/1,1/1,2/1,3/1,3/4,4/1,5/1,6/4,7/4,8/1"
    run = torch.ops.rope_variants.run
    libs = bench_ops.load_libraries(on_cuda=True)
    liger = libs.attr("liger", "LigerRopeFunction")
    if liger is None:
        print(f"Liger not run: {libs.missing.get('liger', 'no LigerRopeFunction')}")
    bandwidth = harness.copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth:.0f} GB/s")

    # A shape that runs L2-resident (harness.l2_resident) gives every call of a candidate one
    # output pair, as the sweep's graphs reuse their outputs' buffers; otherwise each call has
    # its own.
    shared = {}

    def ours(variant, head_blocks):
        def factory(inputs):
            q, k, cos, sin = inputs
            if args.in_place:
                q_out, k_out = q, k
            else:
                q_out, k_out = shared.get("outputs") or (torch.empty_like(q), torch.empty_like(k))

            def call():
                run(q, k, cos, sin, q_out, k_out, variant, head_blocks)
                return q_out, k_out
            return call
        return factory

    impls = [("liger", lambda inputs: (lambda: liger.apply(*inputs)))] if liger else []
    for spec in args.variants.split(","):
        variant, head_blocks = (int(x) for x in spec.split("/"))
        impls.append((f"{spec} {NAMES.get(variant, '')}", ours(variant, head_blocks)))
    shapes = SHAPES["big"] + SHAPES["small"] if args.shapes == "all" else SHAPES[args.shapes]
    for b, hq, hkv, s, d, dtype in shapes:
        first = bench_ops.rotate_half_inputs(b, hq, hkv, s, d, "cuda", dtype)
        nbytes = bench_ops.size_of(first) + bench_ops.size_of(first[:2])  # q, k written back
        copies = harness.copies_for_cold_l2(nbytes, cap=SMALL_SETS)
        sets = [first] + [bench_ops.rotate_half_inputs(b, hq, hkv, s, d, "cuda", dtype) for _ in range(copies - 1)]
        shared.clear()
        # each on fresh copies: an in-place variant (and Liger) overwrites its inputs
        reference = ours(0, 1)(tuple(t.clone() for t in first))()
        print(f"\nq[{b},{hq},{s},{d}] k[{b},{hkv},{s},{d}] {str(dtype)[6:]}, {nbytes / 1e6:.1f} MB")
        skipped = untimed(impls[1 if liger else 0:], first, reference)
        if harness.l2_resident(len(sets), bench_ops.size_of(first)):
            shared["outputs"] = (torch.empty_like(first[0]), torch.empty_like(first[1]))
        harness.time_and_print(impls, sets, nbytes, bandwidth, args.reps, skipped, peer="liger", width=42,
                               max_calls=MAX_CALLS)


def untimed(candidates, first, reference):
    """Name -> why, for the candidates that refuse the shape or whose outputs are not
    bit-equal to production's `reference`; each runs on fresh copies of the input set
    `first` (an in-place candidate overwrites its inputs)."""
    skipped = {}
    for name, factory in candidates:
        try:
            out = factory(tuple(t.clone() for t in first))()
        except RuntimeError as error:
            skipped[name] = str(error).splitlines()[0]
            continue
        if not all(torch.equal(o, r) for o, r in zip(out, reference)):
            skipped[name] = "WRONG RESULT (not bit-equal to production)"
    return skipped


def main_interleaved(args):
    """LTX-Video's interleaved RoPE: [1, S, C] q and k, fp32 [1, S, C] tables, against
    torch.compile of the diffusers code (the fastest peer there; Liger has no interleaved
    RoPE)."""
    from kernels import get_local_kernel

    run = torch.ops.rope_variants.run_interleaved
    ltx = get_local_kernel(REPO)
    bench_ops.configure_dynamo()
    builder = bench_ops.CaseBuilder(ltx, bench_ops.load_libraries(on_cuda=True), "cuda")
    bandwidth = harness.copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth:.0f} GB/s")
    for tokens, width in INTERLEAVED_SHAPES:
        first = builder.ltx_rope_inputs(1, tokens, width)
        nbytes = bench_ops.size_of(first) + bench_ops.size_of(first[:2])
        copies = harness.copies_for_cold_l2(nbytes, cap=SMALL_SETS)
        sets = [first] + [builder.ltx_rope_inputs(1, tokens, width) for _ in range(copies - 1)]
        # as the rotate-half shapes: one output pair per candidate where the shape runs L2-resident
        shared = (torch.empty_like(first[0]), torch.empty_like(first[1])) \
            if harness.l2_resident(len(sets), bench_ops.size_of(first)) else None

        def ours(variant, unit_threads):
            def factory(inputs):
                q, k, cos, sin = inputs
                q_out, k_out = shared or (torch.empty_like(q), torch.empty_like(k))

                def call():
                    run(q, k, cos, sin, q_out, k_out, variant, unit_threads)
                    return q_out, k_out
                return call
            return factory

        compiled = bench_ops.compiled(ltx.reference.ltx_rope, "inductor")
        impls = [("compile", lambda inputs: (lambda: compiled(*inputs)))]
        for spec in (args.variants or INTERLEAVED_VARIANTS).split(","):
            variant, unit_threads = (int(x) for x in spec.split("/"))
            impls.append((f"{spec} {NAMES.get(variant, '')}", ours(variant, unit_threads)))
        reference = tuple(t.clone() for t in ours(0, 0)(first)())
        skipped = untimed(impls[1:], first, reference)
        print(f"\nLTX q/k [1,{tokens},{width}] bf16, fp32 tables, {nbytes / 1e6:.2f} MB")
        harness.time_and_print(impls, sets, nbytes, bandwidth, args.reps, skipped, peer="compile", width=30,
                               max_calls=MAX_CALLS)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("rope_variants.py needs a CUDA GPU")
    main()
