"""The PNGs of the op benchmarks. A bench_ops run: % of the copy bandwidth per op and
shape, one series of dots per implementation, one row per shape (ops shaded in bands), so a
run of 50+ shapes stays readable and a gap to the roofline shows at a glance. A sweep: a
heatmap per op of ltx's time over the fastest peer's, rows x width.

    python -m benchmarks.ops.plot part1.json part2.json -o all.png   # one plot of split runs
"""

import argparse
import json
import math
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or the GPU machine
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402

# ltx first and loudest; peers in a fixed order and colour so runs compare by eye.
STYLE = {
    "ltx": dict(color="#d62728", marker="*", s=110, zorder=5),
    "eager": dict(color="#7f7f7f", marker="o", s=30),
    "compile": dict(color="#1f77b4", marker="s", s=30),
    "F.rms_norm": dict(color="#2ca02c", marker="^", s=34),
    "liger": dict(color="#9467bd", marker="D", s=28),
    "quack": dict(color="#ff7f0e", marker="P", s=40),
}


def save_copy_bandwidth_plot(report: dict, path: Path) -> None:
    rows = report["results"]
    cases: List[Tuple[str, str]] = list(dict.fromkeys((r["op"], r["shape"]) for r in rows))
    if not cases:
        return
    position = {case: i for i, case in enumerate(cases)}
    fig, ax = plt.subplots(figsize=(11, 1.8 + 0.3 * len(cases)), layout="constrained")

    # A light band on every other op (its fwd+bwd rows included) so its shapes read as a group.
    family = [op.removesuffix(" fwd+bwd") for op, _ in cases]
    starts = [i for i in range(len(cases)) if i == 0 or family[i] != family[i - 1]] + [len(cases)]
    for first, end in list(zip(starts, starts[1:]))[::2]:
        ax.axhspan(first - 0.5, end - 0.5, color="#f2f2f2", zorder=0)

    series: Dict[str, List[dict]] = {}
    for r in rows:
        series.setdefault(r["impl"], []).append(r)
    for impl in [name for name in STYLE if name in series] + sorted(set(series) - set(STYLE)):
        style = STYLE.get(impl, dict(marker="x", s=30))
        points = series[impl]
        ax.scatter([p["pct_copy"] for p in points], [position[(p["op"], p["shape"])] for p in points],
                   label=impl, **{"zorder": 3, **style})

    ax.axvline(100, color="black", linewidth=1)
    ax.axvline(90, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels([f"{op}  {shape}" for op, shape in cases], fontsize=8)
    ax.set_ylim(len(cases) - 0.5, -0.5)  # first case at the top, as in the table
    top = max([100.0] + [r["pct_copy"] for r in rows])
    ax.set_xlim(0, top * 1.05)
    ax.grid(axis="x", color="#dddddd", zorder=1)
    timing = "kernel time (CUDA graph, cold L2)" if report.get("timing", "").startswith("cuda") else "CPU wall time"
    ax.set_xlabel(f"% of copy bandwidth ({report['copy_gbs']:.0f} GB/s measured in this run), from {timing}; "
                  "dashed: 90%")
    ax.set_title(f"bench_ops on {report['device']}, {report['date']}", fontsize=11)
    fig.legend(loc="outside lower center", ncol=len(series), frameon=False, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_sweep_heatmap(report: dict, op: str, rows: Sequence[int], widths: Sequence[int], path: Path) -> None:
    """ltx / fastest peer for each measured cell of `op`: a panel per pass and dtype, rows
    (log2) by width, the axes holding the sizes measured. Green is ahead, red behind; a
    black frame marks a cell that misses its target (see sweep.py), grey is not measured."""
    cells = [c for c in report["cells"] if c["op"] == op and "ratio" in c]
    if not cells:
        return
    panels = sorted({(c["backward"], c["dtype"]) for c in cells}, key=lambda p: (p[0], ["bf16", "fp16", "fp32"].index(p[1])))
    used_rows = [r for r in rows if any(c["rows"] == r for c in cells)]
    used_widths = [w for w in widths if any(c["width"] == w for c in cells)]
    timing = "kernel time" if report["on_cuda"] else "wall time"
    norm = TwoSlopeNorm(vmin=math.log2(1 / 1.5), vcenter=0.0, vmax=math.log2(1.5))
    fig, axes = plt.subplots(len(panels), 1, squeeze=False, layout="constrained",
                             figsize=(max(6.0, 3 + 0.22 * len(used_widths)),
                                      1.2 + len(panels) * (0.9 + 0.22 * max(len(used_rows), 5))))
    text_size = 4.5 if len(used_widths) > 20 else 7
    for ax, (backward, dtype) in zip(axes[:, 0], panels):
        grid = [[math.nan] * len(used_widths) for _ in used_rows]
        for c in cells:
            if (c["backward"], c["dtype"]) != (backward, dtype):
                continue
            i, j = used_rows.index(c["rows"]), used_widths.index(c["width"])
            grid[i][j] = math.log2(c["ratio"])
            ax.text(j, i, f"{c['ratio']:.2f}", ha="center", va="center", fontsize=text_size)
            if c.get("meets_target") is False:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.2))
        image = ax.imshow(grid, cmap="RdYlGn_r", norm=norm, aspect="auto", origin="lower")
        ax.set_facecolor("#e6e6e6")
        ax.set_xticks(range(len(used_widths)))
        ax.set_xticklabels(used_widths, rotation=90, fontsize=6)
        ax.set_yticks(range(len(used_rows)))
        ax.set_yticklabels(used_rows, fontsize=6)
        ax.set_ylabel("rows", fontsize=8)
        ax.set_title(f"{op}{' fwd+bwd' if backward else ''} {dtype}", fontsize=9)
    axes[-1, 0].set_xlabel("width (last dim)", fontsize=8)
    ticks = [1 / 1.5, 1 / 1.25, 1 / 1.1, 1, 1.05, 1.1, 1.25, 1.5]
    bar = fig.colorbar(image, ax=axes[:, 0], ticks=[math.log2(t) for t in ticks], shrink=0.8)
    bar.ax.set_yticklabels([f"{t:.2f}" for t in ticks], fontsize=6)
    bar.set_label(f"ltx / fastest peer ({timing})", fontsize=7)
    fig.suptitle(f"{op}: sweep on {report['device']}, {report['date']}", fontsize=10)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description="Plot bench_ops JSON reports (split runs merge into one plot).")
    parser.add_argument("reports", type=Path, nargs="+")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    reports = [json.loads(path.read_text()) for path in args.reports]
    # Each row's % of copy bandwidth is against its own run's copy; the axis names the first.
    merged = {**reports[0], "results": [row for report in reports for row in report["results"]]}
    save_copy_bandwidth_plot(merged, args.output)


if __name__ == "__main__":
    main()
