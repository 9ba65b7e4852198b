"""The kernels behind a sweep cell's time: each implementation of the cell (ltx and every
peer, as the sweep builds them) captured in a CUDA graph and replayed under torch.profiler,
with the kernels one call launches and each one's median duration. Where the sweep says a
cell trails its fastest peer, this says whether ltx launches more kernels or runs a slower
one, and which.

    python -m benchmarks.ops.kernel_breakdown --missed benchmarks/results/sweep_ops/sweep.json --top 12
    python -m benchmarks.ops.kernel_breakdown --cell "rms_norm fwd+bwd bf16 1x4096" --cell "geglu bf16 1x8192"

A kernel's duration is its own run time from the profiler's trace (the gaps between a
graph's kernels are not in it); the sum over a call's kernels is therefore at most the
sweep's kernel time, which is a whole replay's. One input set, L2-warm: the kernels' order
and count, and their relative times, are the point, not cold-L2 times.
"""

import argparse
import json
import re
import statistics
import sys
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch

from benchmarks.ops import bench_ops, sweep

CELL = re.compile(r"^(?P<op>\w+)(?P<bwd> fwd\+bwd)? (?P<dtype>bf16|fp16|fp32) (?P<rows>\d+)x(?P<width>\d+)$")


def parse_cell(text: str) -> sweep.Cell:
    """A cell from its label as the sweep writes it ("rms_norm fwd+bwd bf16 1x4096")."""
    m = CELL.match(text.strip())
    if m is None or m["op"] not in sweep.SWEEP_OPS:
        raise ValueError(f"not a sweep cell: {text!r} (e.g. 'rms_norm fwd+bwd bf16 1x4096'; ops: "
                         f"{' '.join(sweep.SWEEP_OPS)})")
    return sweep.Cell(m["op"], int(m["rows"]), int(m["width"]), m["dtype"], m["bwd"] is not None)


def worst_missed(report: dict, top: int) -> List[sweep.Cell]:
    """The `top` cells of a sweep.json that missed the targets, the furthest behind first:
    by ratio from 1 MB up, by gap below (the two targets' own measures), alternating."""
    missed = [c for c in report["cells"] if c.get("meets_target") is False]
    large = sorted((c for c in missed if c["bytes"] >= sweep.MB), key=lambda c: -c["ratio"])
    small = sorted((c for c in missed if c["bytes"] < sweep.MB), key=lambda c: -c["gap_us"])
    chosen = list(sweep.roundrobin(large, small))[:top]
    return [sweep.Cell(c["op"], c["rows"], c["width"], c["dtype"], c["backward"]) for c in chosen]


def kernels_per_call(call: Callable[[], object], replays: int = 20) -> List[dict]:
    """The kernels one call launches, in launch order, each with its median duration (us)
    over `replays` replays of a graph of the call."""
    from torch.profiler import ProfilerActivity, profile

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # lazy init and autotuning stay out of the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    del out, graph
    if not events or len(events) % replays:
        raise RuntimeError(f"the profiler saw {len(events)} kernels over {replays} replays")
    per_call = len(events) // replays
    return [{"kernel": events[k].name,
             "us": statistics.median(events[r * per_call + k].device_time for r in range(replays))}
            for k in range(per_call)]


def short_name(kernel: str, width: int = 70) -> str:
    """A kernel's name without its template arguments' namespaces, cut to `width`."""
    name = re.sub(r"\b(?:ltx|c10|at|native|norm_cuda|\(anonymous namespace\))::", "", kernel)
    name = name.removeprefix("void ")
    return name if len(name) <= width else name[: width - 3] + "..."


def breakdown(builder: bench_ops.CaseBuilder, cell: sweep.Cell, impls: Sequence[str]) -> Dict[str, object]:
    """Every implementation's kernels for one cell (or why it has none)."""
    torch._dynamo.reset()  # as the sweep: each cell's compile peer compiles afresh
    case = sweep.case_of(builder, cell)
    inputs = case.inputs()
    result: Dict[str, object] = {}
    for name, fn in case.impls.items():
        if impls and name not in impls:
            continue
        try:
            result[name] = kernels_per_call(lambda: fn(*inputs))
        except Exception as e:  # a peer that cannot take the cell: say so, go on
            result[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return result


def markdown(cell: sweep.Cell, result: Dict[str, object]) -> str:
    lines = [f"## {cell.label}", "", "| impl | kernels | sum us | kernels in launch order (us) |", "|---|---|---|---|"]
    for name, kernels in result.items():
        if isinstance(kernels, str):
            lines.append(f"| {name} | – | – | {kernels} |")
            continue
        listed = "; ".join(f"{short_name(k['kernel'])} {k['us']:.2f}" for k in kernels)
        lines.append(f"| {name} | {len(kernels)} | {sum(k['us'] for k in kernels):.2f} | {listed} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cell", action="append", default=[], help="a sweep cell's label (repeatable)")
    parser.add_argument("--missed", type=Path, help="a sweep.json: its cells that missed the targets")
    parser.add_argument("--top", type=int, default=12, help="with --missed: how many, the furthest behind first")
    parser.add_argument("--impls", default="", help="comma-separated implementations (default: all of the cell's)")
    parser.add_argument("--json", type=Path, help="write every cell's kernels here too")
    args = parser.parse_args(argv)
    cells = [parse_cell(text) for text in args.cell]
    if args.missed:
        cells += worst_missed(json.loads(args.missed.read_text()), args.top)
    if not cells:
        parser.error("name cells with --cell or --missed")
    if not torch.cuda.is_available():
        sys.exit("kernel_breakdown: needs a CUDA GPU")

    from kernels import get_local_kernel

    warnings.filterwarnings("ignore", message=".*autograd kernel was not registered")
    torch.manual_seed(0)
    ltx = get_local_kernel(bench_ops.REPO)
    bench_ops.configure_dynamo()
    builder = bench_ops.CaseBuilder(ltx, bench_ops.load_libraries(True), "cuda", compile_peer=True)
    impls = [i for i in args.impls.split(",") if i]
    print(f"# Kernels per call on {torch.cuda.get_device_name()}\n", flush=True)
    results = []
    for cell in sweep.dedupe(cells):
        result = breakdown(builder, cell, impls)
        print(markdown(cell, result), flush=True)
        results.append({"cell": cell.label, "impls": result})
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "cells": results}, indent=1))


if __name__ == "__main__":
    main()
