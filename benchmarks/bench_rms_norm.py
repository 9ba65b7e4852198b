"""RMSNorm: our kernel against PyTorch eager (the Llama module's math), F.rms_norm,
torch.compile of the eager reference and Liger-Kernel (when installed).

    python benchmarks/bench_rms_norm.py [--quick] [--json out.json]

Prints a Markdown table: kernel time (CUDA graph, cold L2), eager call time, GB/s and
% of the copy bandwidth measured in the same run.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import copies_for_cold_l2, copy_bandwidth_gbs, eager_time_us, graph_time_us  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# (rows, D, has_weight): the model shapes (LTX per-token, Llama/Qwen hidden, per-head qk-norm).
SHAPES = [
    (1024, 2048, True), (128, 4096, True), (4096, 4096, True), (8192, 4096, True),
    (32768, 4096, True), (32768, 8192, True), (5376, 2048, False), (648720, 128, True),
    (8192, 1536, True), (8192, 65536, True),
]
QUICK_SHAPES = [(128, 4096, True), (8192, 4096, True), (648720, 128, True)]


def eager_reference(x, w, eps):
    """transformers' Llama RMSNorm."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h.to(x.dtype)
    return h * w if w is not None else h


def implementations(kernel):
    """name -> (fn(x, weight, eps), whether it needs a weight). Call once per shape and
    dtype: the compiled reference is specialised to one (dynamic=False)."""
    torch._dynamo.reset()
    impls = {
        "ltx": (lambda x, w, eps: kernel.rms_norm(x, w, eps), False),
        "eager": (eager_reference, False),
        "F.rms_norm": (lambda x, w, eps: torch.nn.functional.rms_norm(x, x.shape[-1:], w, eps), False),
        "compile": (torch.compile(eager_reference, dynamic=False), False),
    }
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        impls["liger"] = (LigerRMSNormFunction.apply, True)
    except ImportError:
        pass
    return impls


def run(shapes, dtypes):
    from kernels import get_local_kernel

    kernel = get_local_kernel(REPO)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"copy bandwidth: {copy_gbs:.0f} GB/s\n")
    rows_out = []
    header = "| shape | dtype | impl | kernel us | eager us | GB/s | % copy BW |"
    print(header + "\n|---|---|---|---|---|---|---|")
    for rows, d, has_weight in shapes:
        for dtype in dtypes:
            elem = torch.finfo(dtype).bits // 8
            nbytes = 2 * rows * d * elem + (d * elem if has_weight else 0)
            copies = copies_for_cold_l2(nbytes)
            xs = [torch.randn(rows, d, device="cuda", dtype=dtype) for _ in range(copies)]
            w = torch.randn(d, device="cuda", dtype=dtype) if has_weight else None
            expected = eager_reference(xs[0].double(), w.double() if w is not None else None, 1e-6)
            for name, (fn, needs_weight) in implementations(kernel).items():
                if needs_weight and w is None:
                    continue
                err = (fn(xs[0], w, 1e-6).double() - expected).abs().max().item()
                kernel_us = graph_time_us([lambda x=x: fn(x, w, 1e-6) for x in xs])
                eager_us = eager_time_us(lambda: fn(xs[0], w, 1e-6))
                gbs = nbytes / kernel_us / 1e3
                row = dict(rows=rows, d=d, weight=has_weight, dtype=str(dtype).split(".")[-1], impl=name,
                           kernel_us=kernel_us, eager_us=eager_us, gbs=gbs, pct_copy=100 * gbs / copy_gbs,
                           max_abs_err=err)
                rows_out.append(row)
                print(f"| {rows}x{d}{'' if has_weight else ' (no w)'} | {row['dtype']} | {name} | "
                      f"{kernel_us:.1f} | {eager_us:.1f} | {gbs:.0f} | {row['pct_copy']:.0f}% |", flush=True)
            del xs
            torch.cuda.empty_cache()
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbs=copy_gbs,
                results=rows_out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="three shapes, bf16 only")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rms_norm: needs a CUDA GPU")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16, torch.float32]
    result = run(shapes, dtypes)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
