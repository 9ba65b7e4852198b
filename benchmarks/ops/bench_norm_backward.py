"""The norm backward kernels alone (no forward, no autograd), on a CUDA GPU: kernel time
by CUDA-graph replay with inputs rotated past L2 (harness.py), and % of the copy
bandwidth measured in the same run. bench_ops.py --backward times forward+backward
through autograd; this isolates the backward op to tune it.

    python -m benchmarks.ops.bench_norm_backward [--json out.json]

Bytes counted: x and dy read, dx written (and the extra grad read when given; per-token
AdaLN also reads its [B,S,D] scale and writes its two per-row column-grad tensors). The
column-grad sums, the weight or broadcast scale and AdaLN's saved row statistics (8 bytes a
row) are small and not counted. The gated
residual's backward reads x and dy and writes dx (a per-token gate: also reads the gate and
writes its grad); its "torch" rows time the two PyTorch expressions it replaces.
gated_residual_adaln's backward reads the sum, its input, dy and the sum's own grad and
writes the grads of the residual and the input (six passes); its "two ops" rows time
adaln_backward then gated_residual_backward, which read the residual's grad back (seven).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks import harness

REPO = Path(__file__).resolve().parents[2]
BF16 = torch.bfloat16


def kernel_us(make_call, nbytes):
    copies = harness.copies_for_cold_l2(nbytes)
    calls = [make_call() for _ in range(copies)]
    calls = [calls[i % copies] for i in range(harness.calls_per_graph(copies, nbytes))]
    return harness.graph_time_us(calls)


def rms_case(ops, rows, cols, dtype=BF16, weight_dtype=None, weight=True, extra=False):
    def make_call():
        x = torch.randn(rows, cols, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        w = torch.randn(cols, device="cuda", dtype=weight_dtype or dtype) if weight else None
        ex = torch.randn_like(x) if extra else None
        return lambda: ops.rms_norm_backward(dy, x, w, 1e-6, 0.0, True, ex)

    weight_name = str(weight_dtype or dtype)[6:] if weight else "none"
    name = f"rms_norm_backward {rows}x{cols} {str(dtype)[6:]} weight {weight_name}{' + extra grad' if extra else ''}"
    return name, make_call, rows * cols * dtype.itemsize * (4 if extra else 3)


def adaln_case(ops, batch, tokens, cols, norm="rms", per_token=False, saved_stats=True):
    """saved_stats: the forward's row statistics given, as autograd calls it; else recomputed."""
    def make_call():
        x = torch.randn(batch, tokens, cols, device="cuda", dtype=BF16)
        dy = torch.randn_like(x)
        scale = torch.randn(batch, tokens if per_token else 1, cols, device="cuda", dtype=BF16) * 0.1
        shift = torch.randn_like(scale)
        stats = ops.adaln_with_stats(x, scale, shift, 1e-6, norm)[1] if saved_stats else None
        return lambda: ops.adaln_backward(dy, x, scale, shift, 1e-6, norm, None, stats)

    mod = f"[{batch},{tokens},{cols}]" if per_token else f"[{batch},1,{cols}]"
    stats = "" if saved_stats else ", statistics recomputed"
    name = f"adaln_backward {norm} [{batch},{tokens},{cols}] scale/shift {mod} bfloat16{stats}"
    return name, make_call, batch * tokens * cols * BF16.itemsize * (6 if per_token else 3)


def gated_case(ops, batch, tokens, cols, per_token=False, torch_formula=False):
    def make_call():
        x = torch.randn(batch, tokens, cols, device="cuda", dtype=BF16)
        dy = torch.randn_like(x)
        gate = torch.randn(batch, tokens if per_token else 1, cols, device="cuda", dtype=BF16)
        if torch_formula:
            return lambda: (dy * gate, (dy * x).sum_to_size(gate.shape))
        return lambda: ops.gated_residual_backward(dy, x, gate)

    gate = f"[{batch},{tokens},{cols}]" if per_token else f"[{batch},1,{cols}]"
    who = "torch dy * gate, (dy * x).sum_to_size" if torch_formula else "gated_residual_backward"
    name = f"{who} [{batch},{tokens},{cols}] gate {gate} bfloat16"
    return name, make_call, batch * tokens * cols * BF16.itemsize * (5 if per_token else 3)


def gated_adaln_case(ops, batch, tokens, cols, norm="rms", two_ops=False):
    def make_call():
        x, residual, dy, dsum = (torch.randn(batch, tokens, cols, device="cuda", dtype=BF16) for _ in range(4))
        gate, scale, shift = (torch.randn(batch, 1, cols, device="cuda", dtype=BF16) * 0.1 for _ in range(3))
        summed, _, stats = ops.gated_residual_adaln_with_stats(residual, x, gate, scale, shift, 1e-6, norm)
        if two_ops:
            def call():
                grad_sum = ops.adaln_backward(dy, summed, scale, shift, 1e-6, norm, dsum, stats)[0]
                return ops.gated_residual_backward(grad_sum, x, gate)
            return call
        return lambda: ops.gated_residual_adaln_backward(dy, dsum, summed, x, gate, scale, shift, 1e-6, norm, stats)

    who = "adaln_backward + gated_residual_backward" if two_ops else "gated_residual_adaln_backward"
    name = f"{who} {norm} [{batch},{tokens},{cols}] gate/scale/shift [{batch},1,{cols}] bfloat16"
    return name, make_call, batch * tokens * cols * BF16.itemsize * 6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_norm_backward.py times CUDA kernels: it needs a CUDA GPU")
    from kernels import get_local_kernel

    ops = get_local_kernel(REPO).ops
    copy_gbs = harness.copy_bandwidth_gbs()
    cases = [
        rms_case(ops, 32768, 4096), rms_case(ops, 32768, 4096, extra=True), rms_case(ops, 8192, 4096),
        rms_case(ops, 32768, 8192), rms_case(ops, 8192, 16384), rms_case(ops, 4096, 32768),
        rms_case(ops, 2048, 65536), rms_case(ops, 8192, 65536), rms_case(ops, 8192, 1536),
        rms_case(ops, 648720, 128), rms_case(ops, 5376, 2048, weight=False),
        rms_case(ops, 32768, 4096, weight_dtype=torch.float32), rms_case(ops, 32768, 4096, dtype=torch.float16),
        rms_case(ops, 32768, 4096, dtype=torch.float32),
        adaln_case(ops, 2, 21504, 2048), adaln_case(ops, 2, 2688, 2048), adaln_case(ops, 2, 21504, 2048, "layer"),
        adaln_case(ops, 2, 2688, 2048, "layer"), adaln_case(ops, 2, 2688, 2048, per_token=True),
        adaln_case(ops, 2, 21504, 2048, saved_stats=False), adaln_case(ops, 2, 21504, 2048, "layer", saved_stats=False),
        gated_case(ops, 2, 21504, 2048), gated_case(ops, 2, 21504, 2048, torch_formula=True),
        gated_case(ops, 2, 2688, 2048), gated_case(ops, 2, 2688, 2048, torch_formula=True),
        gated_case(ops, 2, 2688, 2048, per_token=True),
        *(gated_adaln_case(ops, 2, tokens, 2048, norm, two_ops) for tokens in (21504, 2688)
          for norm in ("rms", "layer") for two_ops in (False, True)),
    ]
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {copy_gbs:.0f} GB/s (read + write)\n")
    print("| op, shape | kernel us | MB moved | % copy BW |\n|---|---|---|---|")
    rows = []
    for name, make_call, nbytes in cases:
        us = kernel_us(make_call, nbytes)
        pct = 100 * nbytes / us / 1e3 / copy_gbs
        rows.append(dict(case=name, kernel_us=us, mb_moved=nbytes / 1e6, pct_copy_bw=pct))
        print(f"| {name} | {us:.1f} | {nbytes / 1e6:.1f} | {pct:.0f}% |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_gbs=copy_gbs, rows=rows), indent=1))


if __name__ == "__main__":
    main()
