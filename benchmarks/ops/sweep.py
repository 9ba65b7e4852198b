"""Every op over a grid of sizes against its peers, to find where it falls behind: hidden
sizes 256 to 16384 in steps of 256 plus the model widths off that grid (1152), rows 1
(decode) to 65536 in powers of two; forward, and forward+backward where the op has a
backward; bf16 and fp16, fp32 on a coarser grid. The cases, peers and timing are
bench_ops' (``CaseBuilder``, ``Runner``): kernel time by CUDA-graph replay and eager call
time, each implementation checked against fp64 first, torch.compile compiled per shape
(dynamo reset per cell, ``fullgraph=True``, the recompile limit raised, and a compile peer
that ran eagerly fails with ``CompileFellBack`` instead of being timed as eager).

    python -m benchmarks.ops.sweep                      # the GPU sweep: about 8 minutes on an H200
    python -m benchmarks.ops.sweep --budget-s 120 --ops rms_norm,fused_add_rms_norm
    python -m benchmarks.ops.sweep --resume benchmarks/results/sweep_ops/sweep.json   # more cells
    python -m benchmarks.ops.sweep --cpu                # the CPU twins against PyTorch eager: the CPU table
    python -m benchmarks.ops.sweep --cpu --smoke        # seconds: CI
    python -m benchmarks.ops.sweep --render benchmarks/results/sweep_ops/sweep.json  # Markdown and PNGs again

How the GPU grid is sampled to fit one run (the whole grid is 13 ops x 65 widths x 17 row
counts x 3 dtypes x 2 passes): each op has five streams of cells, (A) bf16 forward over
every row count at the op's model width (4096 for the LLM ops, 2048 for LTX-Video's, 8192
for the activations), (B) bf16 forward over every width at 4096 rows, (C) the same at one
row (decode), (D) bf16 forward+backward over every row count at the model width, and (E)
cells drawn at random (seed 0) from the whole grid: any width and row count, bf16 or fp16,
forward or forward+backward, and fp32 at widths that are multiples of 1024 and row
counts that are powers of four. A stream lists its sizes coarse to fine (the ends and the
middle first, then the points between), so that any prefix of it spreads over its axis.
The run takes the issue's named gaps first (fused_add_rms_norm at widths 4096-8192 with one
and 8192 rows, rope_rotate_half at decode with 1-8 sequences), then one cell from each
stream of each op in turn, op by op, until its time budget is spent (``--budget-s``,
counted from the start, default 420 s: the rest is the outputs), so every op gets an equal
share and the plan's first cells are the same in every run. ``--resume`` runs the plan's
next cells and merges them with an earlier run's. Where only few files can come back from
the GPU machine, keep the JSON and ``--render`` the rest here.

Sizes: a cell's size is the bytes its call moves (inputs read once, outputs written once).
Targets, from the issue: at 1 MB and more ltx within 5% of the fastest peer's kernel time;
below 1 MB (decode sizes) at most 0.2 us behind it. Below about 2 MB of input the rotated
input sets are capped at 192, so those cells are partly L2-warm, as a decode step's
activations are.

The CPU sweep (``--cpu``) times the CPU twins against the eager PyTorch code they replace
and F.rms_norm, fp32 and bf16, forward at rows 1-2048 and widths 512-4096 and
forward+backward at two sizes, every implementation of a cell in interleaved rounds
(``harness.cpu_times_us``), median of 15 rounds of at least 2 ms each, on the threads
``--threads`` sets (default 2). On a machine shared with other work it notes the share of
the CPU other processes took while each cell ran, and times again, once the machine is
quiet, the cells timed while they took over 10% (``--remeasure-passes``,
``--quiet-wait-s``): a thread of a parallel region left waiting for a core costs a
scheduler slice, milliseconds, whatever the code. Its target: no twin slower than the
fastest peer at 1 MB and more.

Outputs (default): benchmarks/results/sweep_ops/ (GPU) or sweep_ops_cpu/ (CPU, smoke: none
unless --out-dir): sweep.json (every implementation's row, every cell's summary, the plan's
cells not reached), worst.md (the targets' standing, per op, and the worst cells) and a
heatmap per op, <op>.png (ltx / fastest peer over rows x width, a panel per dtype and pass).
"""

import argparse
import datetime
import importlib.util
import itertools
import json
import random
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from benchmarks import harness
from benchmarks.ops import bench_ops
from benchmarks.ops.bench_ops import BF16, FP16, FP32, CaseBuilder, Case

ROWS = tuple(2 ** k for k in range(17))  # 1 .. 65536
MODEL_WIDTHS = (1152, 1536, 2304, 2560, 3584, 5120, 6144, 7168)
WIDTHS = tuple(sorted(set(range(256, 16384 + 1, 256)) | set(MODEL_WIDTHS)))
DTYPES = {"bf16": BF16, "fp16": FP16, "fp32": FP32}
HEAD_DIM = 128
DECODE_BATCH = 64  # rope_rotate_half: up to this many rows are one token of each of that many sequences
MB = 1 << 20
TARGET_RATIO, TARGET_GAP_US = 1.05, 0.2  # the GPU targets: at >= 1 MB, and below it
QUIET_LOAD = 0.1  # CPU sweep: a cell timed while others took more of the machine is timed again
RESULTS = bench_ops.RESULTS


def rope_sequences(rows: int) -> Tuple[int, int]:
    """(batch, sequence length) of rope_rotate_half's rows: a decode step of `rows`
    sequences up to DECODE_BATCH, else one sequence of `rows` tokens."""
    return (rows, 1) if rows <= DECODE_BATCH else (1, rows)


@dataclass(frozen=True)
class SweepOp:
    """An op of the sweep: its case at (rows, width, dtype), and the model width its row
    axis is swept at. The cases are bench_ops'."""

    make: Callable[[CaseBuilder, int, int, torch.dtype], Case]
    model_width: int
    max_width_fp32: int = 16384  # widest fp32 row the op takes on CUDA


SWEEP_OPS: Dict[str, SweepOp] = {
    "rms_norm": SweepOp(lambda b, r, w, dt: b.rms_norm_case(r, w, dt), 4096),
    "fused_add_rms_norm": SweepOp(lambda b, r, w, dt: b.fused_add_rms_norm_case(r, w, dt), 4096),
    "adaln_rms": SweepOp(lambda b, r, w, dt: b.adaln_case("rms", 1, r, w, False, dt), 2048),
    "adaln_layer": SweepOp(lambda b, r, w, dt: b.adaln_case("layer", 1, r, w, False, dt), 2048),
    "gated_residual": SweepOp(lambda b, r, w, dt: b.gated_residual_case(1, r, w, dt), 2048),
    "gated_residual_adaln_rms": SweepOp(lambda b, r, w, dt: b.gated_residual_adaln_case("rms", 1, r, w, dt), 2048),
    "gated_residual_adaln_layer": SweepOp(lambda b, r, w, dt: b.gated_residual_adaln_case("layer", 1, r, w, dt), 2048),
    # q of `width` channels in heads of 128, k a quarter of the heads (GQA)
    "rope_rotate_half": SweepOp(lambda b, r, w, dt: b.rope_rotate_half_case(
        rope_sequences(r)[0], w // HEAD_DIM, max(1, w // (4 * HEAD_DIM)), rope_sequences(r)[1], HEAD_DIM, dt), 4096),
    "rope_interleaved": SweepOp(lambda b, r, w, dt: b.rope_interleaved_case(1, r, w, dt), 2048),
    "qk_norm_rope": SweepOp(lambda b, r, w, dt: b.qk_norm_rope_case(1, r, w, dt), 2048, max_width_fp32=8192),
    "geglu": SweepOp(lambda b, r, w, dt: b.geglu_case(r, w, dt), 8192),
    "gelu_tanh": SweepOp(lambda b, r, w, dt: b.gelu_tanh_case((r, w), dt), 8192),
    "gelu_mul": SweepOp(lambda b, r, w, dt: b.gelu_mul_case(r, w, dt), 8192),
}
# Ops whose case has no backward (qk_norm_rope: its fwd+bwd is rope's and rms_norm's).
FORWARD_ONLY = {"qk_norm_rope"}


@dataclass(frozen=True)
class Cell:
    op: str
    rows: int
    width: int
    dtype: str  # bf16, fp16, fp32
    backward: bool = False
    stream: str = ""  # which part of the plan chose it

    @property
    def key(self) -> Tuple:
        return (self.op, self.rows, self.width, self.dtype, self.backward)

    @property
    def label(self) -> str:
        return f"{self.op}{' fwd+bwd' if self.backward else ''} {self.dtype} {self.rows}x{self.width}"


# --- the plans ------------------------------------------------------------------------------


def spread(values: Sequence) -> List:
    """values (sorted) reordered so that every prefix spreads over them: both ends, the
    middle, then the midpoints of the gaps left, and so on."""
    n = len(values)
    if n <= 2:
        return list(values)
    order, seen = [0, n - 1], {0, n - 1}
    gaps = [(0, n - 1)]
    while gaps:
        next_gaps = []
        for lo, hi in gaps:
            if hi - lo < 2:
                continue
            mid = (lo + hi) // 2
            if mid not in seen:
                order.append(mid)
                seen.add(mid)
            next_gaps += [(lo, mid), (mid, hi)]
        gaps = next_gaps
    return [values[i] for i in order]


def widths_by_priority() -> List[int]:
    """The model widths and the powers of two first (spread), then the rest of the grid (spread)."""
    first = sorted(set(MODEL_WIDTHS) | {w for w in WIDTHS if w & (w - 1) == 0})
    return spread(first) + spread([w for w in WIDTHS if w not in first])


def named_gaps(ops: Iterable[str]) -> List[Cell]:
    """The issue's gaps: fused_add_rms_norm at widths 4096-8192 (prefill and one token),
    rope_rotate_half at decode (1-8 sequences of one token)."""
    cells = []
    if "fused_add_rms_norm" in ops:
        cells += [Cell("fused_add_rms_norm", rows, width, "bf16", stream="named")
                  for rows in (8192, 1) for width in (4096, 5120, 6144, 7168, 8192)]
    if "rope_rotate_half" in ops:
        cells += [Cell("rope_rotate_half", rows, 4096, "bf16", stream="named") for rows in (1, 2, 4, 8)]
    return cells


def random_cells(op: str, rng: random.Random, count: int) -> List[Cell]:
    fp32_widths = [w for w in WIDTHS if w % 1024 == 0 and w <= SWEEP_OPS[op].max_width_fp32]
    fp32_rows = [r for r in ROWS if r.bit_length() % 2 == 1]  # powers of four
    cells = []
    for _ in range(count):
        dtype = rng.choice(("bf16", "bf16", "fp16", "fp16", "fp32"))
        rows = rng.choice(fp32_rows if dtype == "fp32" else ROWS)
        width = rng.choice(fp32_widths if dtype == "fp32" else WIDTHS)
        backward = op not in FORWARD_ONLY and rng.random() < 0.3 and rows * width <= 1 << 27
        cells.append(Cell(op, rows, width, dtype, backward, stream="random"))
    return cells


def gpu_plan(ops: Sequence[str], seed: int = 0) -> List[Cell]:
    rng = random.Random(seed)
    streams_by_op = []
    for op in ops:
        width = SWEEP_OPS[op].model_width
        streams = [
            [Cell(op, rows, width, "bf16", stream="rows") for rows in spread(ROWS)],
            [Cell(op, 4096, w, "bf16", stream="widths") for w in widths_by_priority()],
            [Cell(op, 1, w, "bf16", stream="widths at decode") for w in widths_by_priority()],
            [] if op in FORWARD_ONLY else
            [Cell(op, rows, width, "bf16", True, stream="rows fwd+bwd") for rows in spread(ROWS) if rows <= 16384],
            random_cells(op, rng, 200),
        ]
        streams_by_op.append(list(roundrobin(*streams)))
    return dedupe(named_gaps(ops) + list(roundrobin(*streams_by_op)))


def missed_cells(report: dict, ops: Sequence[str], forward_only: bool) -> List[Cell]:
    """The cells of an earlier run (its sweep.json) that missed the targets, to time again
    after a change."""
    return [Cell(c["op"], c["rows"], c["width"], c["dtype"], c["backward"], stream="missed")
            for c in report["cells"]
            if c.get("meets_target") is False and c["op"] in ops and not (forward_only and c["backward"])]


CPU_ROWS, CPU_WIDTHS = (1, 16, 128, 512, 2048), (512, 2048, 4096)


def cpu_plan(ops: Sequence[str], smoke: bool) -> List[Cell]:
    if smoke:
        rows, widths, backward_sizes = (1, 8), (256,), ((8, 256),)
    else:
        rows, widths, backward_sizes = CPU_ROWS, CPU_WIDTHS, ((16, 2048), (512, 2048))
    cells = [Cell(op, r, w, dtype, stream="grid")
             for op in ops for dtype in ("fp32", "bf16") for w in widths for r in rows]
    cells += [Cell(op, r, w, dtype, True, stream="grid fwd+bwd")
              for op in ops if op not in FORWARD_ONLY for dtype in ("fp32", "bf16") for r, w in backward_sizes]
    return cells


def roundrobin(*iterables):
    sentinel = object()
    for group in itertools.zip_longest(*iterables, fillvalue=sentinel):
        yield from (item for item in group if item is not sentinel)


def dedupe(cells: Iterable[Cell]) -> List[Cell]:
    seen, out = set(), []
    for cell in cells:
        if cell.key not in seen:
            seen.add(cell.key)
            out.append(cell)
    return out


# --- running -------------------------------------------------------------------------------


GPU_TIMING = bench_ops.Timing(max_copies=192, max_calls=512, replays=10, eager_batches=3, eager_batch_us=5e3)
CPU_TIMING = bench_ops.Timing(cpu_rounds=15, cpu_batch_us=2e3)
SMOKE_TIMING = bench_ops.Timing(cpu_rounds=3)


def case_of(builder: CaseBuilder, cell: Cell) -> Case:
    case = SWEEP_OPS[cell.op].make(builder, cell.rows, cell.width, DTYPES[cell.dtype])
    return bench_ops.with_backward(case) if cell.backward else case


def summarize(cell: Cell, entries: List[dict], on_cuda: bool) -> dict:
    """The cell's standing: ltx's time and the fastest peer's (kernel time on CUDA, wall time
    on the CPU), their ratio and gap, and whether it meets the target at its size."""
    timing = "kernel_us" if on_cuda else "eager_us"
    rows = [e for e in entries if "reason" not in e]
    ours = next((e for e in rows if e["impl"] == "ltx"), None)
    peers = [e for e in rows if e["impl"] != "ltx" and e[timing] is not None]
    summary = dict(asdict(cell), bytes=next((e["bytes"] for e in rows), None),
                   fell_back=[e["impl"] for e in entries if e.get("reason", "").startswith("CompileFellBack")],
                   failed={e["impl"]: e["reason"] for e in entries if "reason" in e})
    if ours is None or not peers:
        return summary
    best = min(peers, key=lambda e: e[timing])
    summary.update(ltx_us=ours[timing], peer=best["impl"], peer_us=best[timing], ratio=ours[timing] / best[timing],
                   gap_us=ours[timing] - best[timing])
    if on_cuda:
        eager_peers = [e for e in peers if e["eager_us"] is not None]
        best_eager = min(eager_peers, key=lambda e: e["eager_us"])
        summary.update(ltx_eager_us=ours["eager_us"], eager_peer=best_eager["impl"],
                       eager_ratio=ours["eager_us"] / best_eager["eager_us"])
    summary["meets_target"] = meets_target(summary, on_cuda)
    return summary


def meets_target(summary: dict, on_cuda: bool) -> Optional[bool]:
    """GPU: within 5% at 1 MB and more, within 0.2 us below. CPU: not slower than the
    fastest peer at 1 MB and more (no target below)."""
    if "ratio" not in summary:
        return None
    if summary["bytes"] >= MB:
        return summary["ratio"] <= (TARGET_RATIO if on_cuda else 1.0)
    return summary["gap_us"] <= TARGET_GAP_US if on_cuda else None


class Sweep:
    """Runs cells in plan order within a time budget and keeps every row and summary. On
    the CPU it also notes how much of the machine other processes took while a cell ran
    (harness.OthersLoad), and remeasure() runs again, once the machine is quiet, the cells
    measured under load."""

    def __init__(self, runner: bench_ops.Runner, builder: CaseBuilder, on_cuda: bool, budget_s: Optional[float],
                 started: float):
        self.runner, self.builder, self.on_cuda = runner, builder, on_cuda
        self.budget_s, self.started = budget_s, started
        self.results: Dict[Tuple, Tuple[dict, List[dict]]] = {}  # cell key -> (summary, rows)
        self.longest_cell_s = 0.0

    @property
    def cells(self) -> List[dict]:
        return [summary for summary, _ in self.results.values()]

    @property
    def rows(self) -> List[dict]:
        return [row for _, rows in self.results.values() for row in rows]

    def run(self, plan: Sequence[Cell]) -> List[Cell]:
        """Runs the plan's cells in order; returns those the budget left out."""
        for i, cell in enumerate(plan):
            elapsed = time.perf_counter() - self.started
            if self.budget_s is not None and elapsed + self.longest_cell_s > self.budget_s:
                return list(plan[i:])
            self.run_cell(cell)
        return []

    def run_cell(self, cell: Cell):
        start, load = time.perf_counter(), harness.OthersLoad()
        try:
            case = case_of(self.builder, cell)
        except Exception as e:
            entries = [dict(op=cell.op, shape=cell.label, impl="all", reason=f"{type(e).__name__}: {e}")]
        else:
            entries = self.runner.run_one(case)
        seconds = time.perf_counter() - start
        self.longest_cell_s = max(self.longest_cell_s, seconds)
        rows = [dict(entry, cell=cell.label, **{f"cell_{k}": v for k, v in asdict(cell).items()}) for entry in entries]
        self.results[cell.key] = (dict(summarize(cell, entries, self.on_cuda), seconds=seconds,
                                       others_load=load.share()), rows)

    def remeasure(self, plan: Sequence[Cell], max_load: float, passes: int, max_wait_s: float):
        """Runs again the cells measured while others took more than max_load of the CPU, up
        to `passes` times, each once the machine is quiet; waits at most max_wait_s in all."""
        deadline = time.perf_counter() + max_wait_s
        for _ in range(passes):
            loaded = [cell for cell in plan if cell.key in self.results
                      and (self.results[cell.key][0]["others_load"] or 0) > max_load]
            if not loaded:
                return
            self.runner.emit(f"(re-measuring {len(loaded)} cells timed while other processes took over "
                             f"{max_load:.0%} of the CPU)")
            for cell in loaded:
                harness.wait_for_quiet(max_load, max(0.0, deadline - time.perf_counter()))
                self.run_cell(cell)


# --- reports -------------------------------------------------------------------------------


def size_label(nbytes: Optional[int]) -> str:
    if nbytes is None:
        return "–"
    return f"{nbytes / MB:.1f} MB" if nbytes >= MB else f"{nbytes / 1024:.0f} KB"


def us(value: Optional[float]) -> str:
    return "–" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def markdown(report: dict, worst: int = 40) -> str:
    on_cuda = report["on_cuda"]
    cells = [c for c in report["cells"] if "ratio" in c]
    timing = "kernel time (CUDA-graph replay)" if on_cuda else "wall time (interleaved rounds, median)"
    lines = [f"# Size sweep on {report['device']}, {report['date']}", "",
             f"Command: `python -m benchmarks.ops.sweep {' '.join(report['argv'])}`; kernel build "
             f"{report['kernel_build']}; " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".",
             f"{len(report['cells'])} cells measured in {report['elapsed_s']:.0f} s, "
             f"{report['not_reached']} of the plan not reached"
             + (f" (budget {report['budget_s']:.0f} s). " if report["budget_s"] else ". ")
             + f"Ratio: ltx / the fastest peer, {timing}; size: bytes a call moves."]
    for name, reason in report["peers_missing"].items():
        lines.append(f"Peer {name} not run: {reason}.")
    fell_back = [c for c in report["cells"] if c["fell_back"]]
    if fell_back:
        lines += ["", f"**torch.compile ran eagerly (CompileFellBack) in {len(fell_back)} cells; those peers are "
                      "not timed:** " + ", ".join(cell_label(c) for c in fell_back)]
    if on_cuda:
        target = (f"Targets: at 1 MB and more, ltx / fastest peer <= {TARGET_RATIO}; below 1 MB, at most "
                  f"{TARGET_GAP_US} us behind it.")
    else:
        target = "Target: at 1 MB and more, no twin slower than the fastest peer (PyTorch eager, F.rms_norm)."
    loaded = [c for c in report["cells"] if (c.get("others_load") or 0) > QUIET_LOAD]
    if not on_cuda:
        lines.append(f"Cells timed while other processes took over {QUIET_LOAD:.0%} of the CPU (after re-measuring): "
                     f"{len(loaded)}" + (": " + ", ".join(cell_label(c) for c in loaded) if loaded else "") + ".")
    missed = [c for c in cells if c.get("meets_target") is False]
    lines += ["", target + f" Cells missing it: {len(missed)} of "
              f"{sum(c.get('meets_target') is not None for c in cells)}.", ""]

    lines += ["## Per op", "",
              "| op | cells | >= 1 MB: worst ratio | median ratio | < 1 MB: worst gap us | missing the target |",
              "|---|---|---|---|---|---|"]
    for op in dict.fromkeys(c["op"] + (" fwd+bwd" if c["backward"] else "") for c in cells):
        mine = [c for c in cells if c["op"] + (" fwd+bwd" if c["backward"] else "") == op]
        large = [c for c in mine if c["bytes"] >= MB]
        small = [c for c in mine if c["bytes"] < MB]
        worst_large = max(large, key=lambda c: c["ratio"], default=None)
        worst_small = max(small, key=lambda c: c["gap_us"], default=None)
        lines.append(f"| {op} | {len(mine)} | "
                     + (f"{worst_large['ratio']:.2f} ({cell_label(worst_large)})" if worst_large else "–") + " | "
                     + (f"{statistics.median(c['ratio'] for c in mine):.2f}") + " | "
                     + (f"{worst_small['gap_us']:+.2f} ({cell_label(worst_small)})" if worst_small else "–") + " | "
                     + f"{sum(c.get('meets_target') is False for c in mine)} |")

    header = ["op", "dtype", "rows x width", "size", "ltx us", "fastest peer us", "ratio", "gap us"]
    if on_cuda:
        header += ["eager: ltx us", "eager ratio"]

    def table(title, chosen):
        out = ["", title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for c in chosen:
            row = [c["op"] + (" fwd+bwd" if c["backward"] else ""), c["dtype"], f"{c['rows']}x{c['width']}",
                   size_label(c["bytes"]), us(c["ltx_us"]), f"{us(c['peer_us'])} ({c['peer']})",
                   f"{c['ratio']:.3f}", f"{c['gap_us']:+.2f}"]
            if on_cuda:
                row += [us(c.get("ltx_eager_us")), f"{c['eager_ratio']:.2f} ({c['eager_peer']})"]
            out.append("| " + " | ".join(row) + " |")
        return out

    large = sorted((c for c in cells if c["bytes"] >= MB), key=lambda c: -c["ratio"])[:worst]
    lines += table(f"## The worst cells at 1 MB and more (by ratio, {min(worst, len(large))} shown)", large)
    small = sorted((c for c in cells if c["bytes"] < MB), key=lambda c: -c["gap_us"])[:worst]
    lines += table(f"## The worst cells below 1 MB (by gap, {min(worst, len(small))} shown)", small)
    failed = [c for c in report["cells"] if "ltx" in c["failed"] or "all" in c["failed"]]
    if failed:
        lines += ["", "## Cells where ltx has no time", ""]
        lines += [f"- {cell_label(c)}: {c['failed'].get('ltx') or c['failed'].get('all')}" for c in failed]
    return "\n".join(lines) + "\n"


def cell_label(c: dict) -> str:
    return f"{c['op']}{' fwd+bwd' if c['backward'] else ''} {c['dtype']} {c['rows']}x{c['width']}"


def comparison(base: dict, new: dict) -> str:
    """Markdown: ltx's kernel time per cell in two runs of the same cells (builds before and
    after a change, e.g. `--missed` on each), with the new run's standing."""
    before = {(c["op"], c["rows"], c["width"], c["dtype"], c["backward"]): c for c in base["cells"]}
    lines = [f"ltx kernel time, {base['kernel_build']} (base) and {new['kernel_build']} (new), on {new['device']}",
             "", "| cell | base us | new us | new / base | fastest peer us | new ratio | new gap us | target |",
             "|---|---|---|---|---|---|---|---|"]
    met = compared = 0
    for c in new["cells"]:
        b = before.get((c["op"], c["rows"], c["width"], c["dtype"], c["backward"]))
        if b is None or c.get("ltx_us") is None or b.get("ltx_us") is None or c.get("peer_us") is None:
            continue
        compared += 1
        met += bool(c["meets_target"])
        lines.append(f"| {cell_label(c)} | {us(b['ltx_us'])} | {us(c['ltx_us'])} | {c['ltx_us'] / b['ltx_us']:.3f} | "
                     f"{us(c['peer_us'])} ({c['peer']}) | {c['ratio']:.3f} | {c['gap_us']:+.2f} | "
                     f"{'met' if c['meets_target'] else 'missed'} |")
    lines += ["", f"{compared} cells in both runs; the new build meets the target in {met}."]
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(report, indent=1))
    render(report, out_dir, ["sweep.json"])


def render(report: dict, out_dir: Path, written: Sequence[str] = ()):
    """worst.md and the heatmaps of a report, into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "worst.md").write_text(markdown(report))
    written = [*written, "worst.md"]
    if importlib.util.find_spec("matplotlib") is None:
        print("sweep: matplotlib is not installed: no heatmaps (--render them where it is)", flush=True)
    else:
        from benchmarks.ops import plot  # matplotlib only when plotting

        for op in dict.fromkeys(c["op"] for c in report["cells"]):
            plot.save_sweep_heatmap(report, op, ROWS, WIDTHS, out_dir / f"{op}.png")
            written.append(f"{op}.png")
    print(f"wrote {out_dir}/: " + ", ".join(written), flush=True)


# --- main ----------------------------------------------------------------------------------


def settle_allocator():
    """glibc serves an allocation above its mmap threshold from fresh pages (a fault every
    4 KB, on each call) until freeing one raises the threshold, up to 32 MB. A model's run is
    past that point within its first step; the CPU sweep starts there too, so that neither
    the twins' outputs nor the eager peers' temporaries are timed paying page faults that a
    run does not."""
    torch.empty((32 << 20) - (64 << 10), dtype=torch.uint8)  # freed at once


def main():
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU twins against PyTorch eager (the CPU table)")
    parser.add_argument("--smoke", action="store_true", help="with --cpu: a few tiny cells, few rounds (CI)")
    parser.add_argument("--ops", help="comma-separated: " + " ".join(SWEEP_OPS))
    parser.add_argument("--budget-s", type=float, help="stop starting cells after this many seconds "
                        "from the start (default: 420 on CUDA, none on the CPU)")
    parser.add_argument("--seed", type=int, default=0, help="the random cells' seed (GPU plan)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (--cpu)")
    parser.add_argument("--remeasure-passes", type=int, default=3,
                        help=f"--cpu: times to run again the cells timed while other processes took over "
                        f"{QUIET_LOAD:.0%}% of the CPU (0: none)")
    parser.add_argument("--quiet-wait-s", type=float, default=1200,
                        help="--cpu: how long, in all, to wait for a quiet machine before those cells")
    parser.add_argument("--missed", type=Path, help="an earlier run's sweep.json: time again only its cells "
                        "that missed the targets (of --ops, forward only with --forward), not the plan")
    parser.add_argument("--forward", action="store_true", help="with --missed: leave out the fwd+bwd cells")
    parser.add_argument("--resume", type=Path, help="an earlier run's sweep.json: run the plan's cells it lacks, "
                        "write both together")
    parser.add_argument("--out-dir", type=Path, help="where sweep.json, worst.md and the heatmaps go")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BASE", "NEW"),
                        help="two runs' sweep.json of the same cells (builds before and after a change): "
                        "ltx's time in each, per cell, as Markdown; runs nothing")
    parser.add_argument("--render", type=Path, help="a sweep.json to render again (worst.md, heatmaps); runs nothing")
    args = parser.parse_args()

    if args.compare:
        print(comparison(*(json.loads(p.read_text()) for p in args.compare)), end="")
        return
    if args.render:
        render(json.loads(args.render.read_text()), args.out_dir or args.render.parent)
        return
    on_cuda = not args.cpu
    if on_cuda and not torch.cuda.is_available():
        sys.exit("sweep: needs a CUDA GPU (or --cpu)")
    if args.smoke and on_cuda:
        sys.exit("sweep: --smoke is a CPU run (--cpu --smoke)")
    ops = args.ops.split(",") if args.ops else list(SWEEP_OPS)
    unknown = set(ops) - set(SWEEP_OPS)
    if unknown:
        sys.exit(f"sweep: unknown ops {sorted(unknown)}; known: {' '.join(SWEEP_OPS)}")
    out_dir = args.out_dir or (None if args.smoke else RESULTS / ("sweep_ops" if on_cuda else "sweep_ops_cpu"))
    budget_s = args.budget_s if args.budget_s is not None else (420.0 if on_cuda else None)
    warnings.filterwarnings("ignore", message=".*autograd kernel was not registered")
    torch.manual_seed(0)
    if not on_cuda:
        torch.set_num_threads(args.threads)
        settle_allocator()

    from kernels import get_local_kernel

    ltx = get_local_kernel(bench_ops.REPO) if on_cuda else get_local_kernel(bench_ops.REPO, backend="cpu")
    libs = bench_ops.load_libraries(on_cuda)
    bench_ops.configure_dynamo()
    builder = CaseBuilder(ltx, libs, "cuda" if on_cuda else "cpu", compile_peer=on_cuda)
    copy_gbs = harness.copy_bandwidth_gbs() if on_cuda else harness.cpu_copy_bandwidth_gbs()
    timing = GPU_TIMING if on_cuda else SMOKE_TIMING if args.smoke else CPU_TIMING
    runner = bench_ops.Runner(on_cuda, copy_gbs, timing)
    runner.emit(f"# sweep on {torch.cuda.get_device_name() if on_cuda else 'CPU'}: {' '.join(sys.argv[1:])}")
    runner.header()

    if args.missed:
        plan = missed_cells(json.loads(args.missed.read_text()), ops, args.forward)
    else:
        plan = gpu_plan(ops, args.seed) if on_cuda else cpu_plan(ops, args.smoke)
    earlier = json.loads(args.resume.read_text()) if args.resume else None
    if earlier:
        done = {tuple(c[k] for k in ("op", "rows", "width", "dtype", "backward")) for c in earlier["cells"]}
        plan = [cell for cell in plan if cell.key not in done]
    sweep = Sweep(runner, builder, on_cuda, budget_s, started)
    left = sweep.run(plan)
    if not on_cuda and not args.smoke and args.remeasure_passes:
        sweep.remeasure(plan, QUIET_LOAD, args.remeasure_passes, args.quiet_wait_s)

    device = torch.cuda.get_device_name() if on_cuda else f"CPU, {torch.get_num_threads()} threads"
    report = dict(device=device, on_cuda=on_cuda, date=datetime.date.today().isoformat(), argv=sys.argv[1:],
                  kernel_build=ltx.__name__, versions=harness.library_versions(), copy_gbs=copy_gbs,
                  timing=asdict(timing), budget_s=budget_s, elapsed_s=time.perf_counter() - started,
                  peers_missing=libs.missing, planned=len(plan), not_reached=len(left),
                  not_reached_cells=[asdict(c) for c in left],
                  cells=sweep.cells, rows=sweep.rows)
    if earlier:
        report.update(cells=earlier["cells"] + sweep.cells, rows=earlier["rows"] + sweep.rows,
                      elapsed_s=earlier["elapsed_s"] + report["elapsed_s"],
                      argv=earlier["argv"] + ["+"] + report["argv"])
    if out_dir:
        write_outputs(report, out_dir)
    else:
        print(markdown(report), flush=True)
    fell_back = [cell_label(c) for c in sweep.cells if c["fell_back"]]
    if fell_back:
        print(f"sweep: WARNING: torch.compile ran eagerly in {len(fell_back)} cells (not timed): "
              + ", ".join(fell_back), flush=True)
    wrong = [row for row in sweep.rows if row["impl"] == "ltx" and row.get("reason", "").startswith("WrongResult")]
    if wrong:
        sys.exit("sweep: ltx computed wrong results: " + "; ".join(f"{r['cell']} ({r['reason']})" for r in wrong))


if __name__ == "__main__":
    main()
