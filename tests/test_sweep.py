"""The size sweep (benchmarks/ops/sweep.py): its CPU smoke runs every op end to end and writes
its outputs, its GPU plan samples the grid as its docstring says, a cell's standing follows
the issue's targets, and a torch.compile peer that runs eagerly fails instead of being timed."""

import json
import math
import sys
import time

import pytest
import torch

from benchmarks import harness
from benchmarks.ops import bench_ops, sweep

MB = 1 << 20


def test_cpu_smoke_sweep_times_every_op_and_writes_its_outputs(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["sweep.py", "--cpu", "--smoke", "--out-dir", str(tmp_path)])
    started = time.perf_counter()
    sweep.main()  # no SystemExit: no ltx result is wrong
    assert time.perf_counter() - started < 45
    report = json.loads((tmp_path / "sweep.json").read_text())

    planned = {cell.key for cell in sweep.cpu_plan(list(sweep.SWEEP_OPS), smoke=True)}
    measured = {(c["op"], c["rows"], c["width"], c["dtype"], c["backward"]) for c in report["cells"]}
    assert measured == planned and report["not_reached"] == 0
    assert {c["op"] for c in report["cells"]} == set(sweep.SWEEP_OPS)
    for cell in report["cells"]:
        assert not cell["failed"], cell  # every implementation checked and timed
        # the summary's ratio is ltx's median wall time over the fastest peer's, from its rows
        rows = [r for r in report["rows"] if r["cell"] == sweep.cell_label(cell)]
        ours = next(r["eager_us"] for r in rows if r["impl"] == "ltx")
        fastest = min(r["eager_us"] for r in rows if r["impl"] != "ltx")
        assert {r["impl"] for r in rows} >= {"ltx", "eager"} and "compile" not in {r["impl"] for r in rows}
        assert cell["ltx_us"] == ours > 0 and math.isclose(cell["ratio"], ours / fastest)
        assert cell["meets_target"] is (None if cell["bytes"] < MB else cell["ratio"] <= 1.0)
    rms_rows = [r for r in report["rows"] if r["cell_op"] == "rms_norm" and not r["cell_backward"]]
    assert {r["impl"] for r in rms_rows} == {"eager", "F.rms_norm", "ltx"}

    worst = (tmp_path / "worst.md").read_text()
    assert "## Per op" in worst and all(f"| {op} |" in worst for op in sweep.SWEEP_OPS)
    for op in sweep.SWEEP_OPS:  # a heatmap per op (matplotlib is a dev requirement)
        assert (tmp_path / f"{op}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rendered = tmp_path / "again"
    monkeypatch.setattr(sys, "argv", ["sweep.py", "--render", str(tmp_path / "sweep.json"), "--out-dir", str(rendered)])
    sweep.main()
    assert (rendered / "worst.md").read_text() == worst


def test_spread_puts_the_ends_and_middles_first():
    order = sweep.spread(list(range(17)))
    assert sorted(order) == list(range(17))
    assert order[:3] == [0, 16, 8] and set(order[:5]) == {0, 4, 8, 12, 16}
    assert set(order[:9]) == set(range(0, 17, 2))
    assert sweep.spread([3]) == [3] and sweep.spread([]) == []


def test_gpu_plan_samples_the_grid_as_documented():
    ops = list(sweep.SWEEP_OPS)
    plan = sweep.gpu_plan(ops)
    assert len({c.key for c in plan}) == len(plan)
    assert plan == sweep.gpu_plan(ops) and plan != sweep.gpu_plan(ops, seed=1)  # seeded
    named = [c for c in plan if c.stream == "named"]
    assert plan[:len(named)] == named and {c.op for c in named} == {"fused_add_rms_norm", "rope_rotate_half"}
    # then round robin: within one cell per stream per op, every op has the first cell of each
    # of its streams (a stream's cell that a named one repeats is not run twice)
    prefix = {c.key for c in plan[:len(named) + 5 * len(ops)]}
    widest_first, fewest_first = sweep.widths_by_priority()[0], sweep.spread(sweep.ROWS)[0]
    for op in ops:
        width = sweep.SWEEP_OPS[op].model_width
        firsts = [(op, fewest_first, width, "bf16", False), (op, 4096, widest_first, "bf16", False),
                  (op, 1, widest_first, "bf16", False)]
        if op not in sweep.FORWARD_ONLY:
            firsts.append((op, fewest_first, width, "bf16", True))
        assert set(firsts) <= prefix, op
        assert any(c.op == op and c.stream == "random" for c in plan[len(named):len(named) + 5 * len(ops)]), op
    for c in plan:
        assert c.rows in sweep.ROWS and c.width in sweep.WIDTHS and c.dtype in sweep.DTYPES
        if c.dtype == "fp32":
            assert c.width % 1024 == 0 and math.log(c.rows, 4) == int(math.log(c.rows, 4))
        if c.op == "qk_norm_rope":
            assert not c.backward and (c.dtype != "fp32" or c.width <= 8192)
    # the row stream covers every row count at the op's model width, the width stream every width
    rms = [c for c in plan if c.op == "rms_norm"]
    bf16_forward = {(c.rows, c.width) for c in rms if c.dtype == "bf16" and not c.backward}
    assert {(rows, 4096) for rows in sweep.ROWS} <= bf16_forward
    assert {(4096, w) for w in sweep.WIDTHS} | {(1, w) for w in sweep.WIDTHS} <= bf16_forward
    assert {1152, 1536, 2304, 2560, 3584, 5120, 6144, 7168} <= set(sweep.WIDTHS)
    assert {"bf16", "fp16", "fp32"} <= {c.dtype for c in rms}
    assert sweep.rope_sequences(1) == (1, 1) and sweep.rope_sequences(64) == (64, 1)
    assert sweep.rope_sequences(128) == (1, 128)


def test_a_cell_meets_the_target_its_size_sets():
    cell = sweep.Cell("rms_norm", 4096, 4096, "bf16")

    def entries(ltx_us, peer_us, nbytes, reason=None):
        rows = [dict(impl="ltx", kernel_us=ltx_us, eager_us=ltx_us + 5, bytes=nbytes),
                dict(impl="liger", kernel_us=peer_us, eager_us=peer_us + 9, bytes=nbytes),
                dict(impl="quack", kernel_us=peer_us * 2, eager_us=peer_us, bytes=nbytes)]
        return rows + ([dict(impl="compile", reason=reason)] if reason else [])

    large = sweep.summarize(cell, entries(104.0, 100.0, 2 * MB), on_cuda=True)
    assert large["peer"] == "liger" and large["meets_target"] and math.isclose(large["ratio"], 1.04)
    assert large["eager_peer"] == "quack" and math.isclose(large["eager_ratio"], 109 / 100)
    assert not sweep.summarize(cell, entries(106.0, 100.0, 2 * MB), on_cuda=True)["meets_target"]
    assert sweep.summarize(cell, entries(2.3, 2.15, MB - 1), on_cuda=True)["meets_target"]  # 0.15 us behind
    assert not sweep.summarize(cell, entries(2.5, 2.2, MB - 1), on_cuda=True)["meets_target"]
    cpu = [dict(impl="ltx", kernel_us=None, eager_us=101.0, bytes=2 * MB),
           dict(impl="eager", kernel_us=None, eager_us=100.0, bytes=2 * MB)]
    assert sweep.summarize(cell, cpu, on_cuda=False)["meets_target"] is False
    assert sweep.summarize(cell, [dict(cpu[0], bytes=MB - 1), dict(cpu[1], bytes=MB - 1)], on_cuda=False)["meets_target"] is None
    fell_back = sweep.summarize(cell, entries(1.0, 1.0, MB, reason="CompileFellBack: ran eagerly"), on_cuda=True)
    assert fell_back["fell_back"] == ["compile"] and "compile" in fell_back["failed"]


def test_missed_cells_and_the_comparison_of_two_runs():
    def summary(cell, ltx_us, peer_us, nbytes=2 * MB):
        rows = [dict(impl="ltx", kernel_us=ltx_us, eager_us=ltx_us, bytes=nbytes),
                dict(impl="compile", kernel_us=peer_us, eager_us=peer_us, bytes=nbytes)]
        return sweep.summarize(cell, rows, on_cuda=True)

    slow, fine = sweep.Cell("rms_norm", 1, 256, "bf16"), sweep.Cell("rms_norm", 4096, 4096, "bf16")
    slow_bwd, other_op = sweep.Cell("rms_norm", 1, 256, "bf16", True), sweep.Cell("geglu", 1, 256, "bf16")
    no_ltx = sweep.summarize(sweep.Cell("rms_norm", 2, 256, "bf16"), [], on_cuda=True)  # every impl failed
    base = dict(kernel_build="base", device="GPU", cells=[
        summary(slow, 2.0, 1.0, nbytes=1024), summary(fine, 100.0, 100.0), summary(slow_bwd, 4.0, 1.0, nbytes=1024),
        summary(other_op, 3.0, 1.0, nbytes=1024), no_ltx])
    missed = sweep.missed_cells(base, ["rms_norm"], forward_only=False)
    assert [(c.rows, c.backward) for c in missed] == [(1, False), (1, True)]
    assert [c.key for c in sweep.missed_cells(base, ["rms_norm", "geglu"], forward_only=True)] == [slow.key, other_op.key]

    new = dict(kernel_build="new", device="GPU", cells=[summary(slow, 1.1, 1.0, nbytes=1024)])
    table = sweep.comparison(base, new)
    row = next(line for line in table.splitlines() if line.startswith("| rms_norm bf16 1x256"))
    assert [v.strip() for v in row.split("|")[2:-1]] == ["2.00", "1.10", "0.550", "1.00 (compile)", "1.100", "+0.10", "met"]
    assert "1 cells in both runs; the new build meets the target in 1." in table


def test_compile_peer_compiles_every_shape_and_fails_when_it_runs_eagerly():
    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256,
                                    fail_on_recompile_limit_hit=False, suppress_errors=False):
        bench_ops.configure_dynamo()
        torch._dynamo.reset()
        try:
            # One compiled function over more shapes than dynamo's default limit of 8: each
            # shape gets its own graph, none runs eagerly.
            compiled = torch.compile(norm, dynamic=False, fullgraph=True, backend="eager")
            for width in range(1, 13):
                before = bench_ops.graphs_compiled()
                x = torch.randn(3, width)
                torch.testing.assert_close(compiled(x), norm(x))
                assert bench_ops.graphs_compiled() == before + 1, width
            peer = bench_ops.compiled(norm, "eager")
            x = torch.randn(4, 8)
            torch.testing.assert_close(peer(x), norm(x))
            eager_only = bench_ops.compiled(torch._dynamo.disable(norm), "eager")
            with pytest.raises(bench_ops.CompileFellBack, match="ran it eagerly"):
                eager_only(x)
        finally:
            torch._dynamo.reset()


def test_cpu_times_are_interleaved_medians_per_call():
    calls = {"fast": 0, "slow": 0}

    def fast():
        calls["fast"] += 1

    def slow():
        calls["slow"] += 1
        time.sleep(0.004)

    times = harness.cpu_times_us({"fast": fast, "slow": slow}, rounds=7)
    assert calls == {"fast": 2 + 7, "slow": 2 + 7}  # warm-up, calibration, one a round
    assert times["slow"] >= 4000 > 10 * times["fast"]
    batched = harness.cpu_times_us({"fast": fast}, rounds=3, min_batch_us=1000)
    assert calls["fast"] > 9 + 2 + 3 and batched["fast"] < 1000


THREAD_PROBE = r"""
import os, sys, torch
from pathlib import Path
from kernels import get_local_kernel

torch.set_num_threads(2)
ltx = get_local_kernel(Path(sys.argv[1]), backend="cpu")
x = torch.randn(4096, 4096)
w = torch.randn(4096)
ltx.rms_norm(x, w)  # the threads start


def cpu_ticks():
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks[tid] = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks


before = cpu_ticks()
for _ in range(40):
    ltx.rms_norm(x, w)
after = cpu_ticks()
print(sum(after[tid] - before.get(tid, 0) > 0 for tid in after))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads per-thread CPU time from /proc")
def test_cpu_twins_run_on_torchs_intra_op_threads(tmp_path):
    # at::parallel_for runs serially in a library built without -fopenmp; the twins' own
    # parallel_rows must put a large call on more than the calling thread.
    import subprocess

    from benchmarks.ops.bench_ops import REPO

    script = tmp_path / "probe.py"
    script.write_text(THREAD_PROBE)
    busy_threads = subprocess.run([sys.executable, str(script), str(REPO)], capture_output=True, text=True,
                                  check=True, timeout=300).stdout.split()[-1]
    assert int(busy_threads) >= 2


def test_kernel_breakdown_reads_the_sweeps_cells():
    """kernel_breakdown takes cells by the sweep's labels and picks a sweep.json's missed
    cells furthest behind first (ratio from 1 MB up, gap below); it needs a GPU to run."""
    from benchmarks.ops import kernel_breakdown

    for cell in (sweep.Cell("rms_norm", 1, 4096, "bf16", True), sweep.Cell("geglu", 4096, 8192, "fp32")):
        assert kernel_breakdown.parse_cell(cell.label) == cell
    for bad in ("rms_norm bf16 1x", "softmax bf16 1x4096", "rms_norm int8 1x4096"):
        with pytest.raises(ValueError):
            kernel_breakdown.parse_cell(bad)

    def summary(op, rows, nbytes, ratio, gap, meets):
        return dict(op=op, rows=rows, width=4096, dtype="bf16", backward=False, bytes=nbytes, ratio=ratio,
                    gap_us=gap, meets_target=meets)

    report = {"cells": [summary("a", 1, MB, 1.08, 0.5, False), summary("b", 2, 4 * MB, 1.30, 9.0, False),
                        summary("c", 3, 1024, 1.9, 0.3, False), summary("d", 4, 2048, 1.2, 0.9, False),
                        summary("e", 5, 8 * MB, 2.0, 50.0, True), summary("f", 6, 64, 3.0, 0.1, None)]}
    chosen = kernel_breakdown.worst_missed(report, top=3)
    assert [(c.op, c.rows) for c in chosen] == [("b", 2), ("d", 4), ("a", 1)]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            kernel_breakdown.main(["--cell", "rms_norm bf16 1x4096"])
