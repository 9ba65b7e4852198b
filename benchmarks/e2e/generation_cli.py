"""What the two generation benchmarks (ltx_pipeline.py, qwen3_generate.py) share: the
seed's configuration flags, the configurations they select, and how a run ends."""

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable, List, Sequence

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIGS = ("baseline", "kernels", "compile", "compile+kernels")


def kernelize_mode(config: str):
    """kernels' mode for a configuration's kernelize call: compiled ones say so, as kernels
    asks (kernelize_transformers then leaves the model to inductor)."""
    from kernels import Mode

    return Mode.INFERENCE | Mode.TORCH_COMPILE if config.startswith("compile") else Mode.INFERENCE


def markdown_table(columns: Sequence[str], runs, cells: Callable[[object], List[str]]) -> str:
    """One row per run: its configuration, then ``cells(run)``, or "failed: ..." for a run
    that has an error."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for run in runs:
        row = [f"failed: {run.error[:80]}"] + ["-"] * (len(columns) - 2) if run.error else cells(run)
        lines.append("| " + " | ".join([run.config, *row]) + " |")
    return "\n".join(lines)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def add_common_arguments(parser: argparse.ArgumentParser, *, stock: str, compiled: str) -> None:
    """The seed's --use-optimized-kernels / --no-optimized-kernels and --compile, --all, and
    the dtype, device, seed, compile backend and JSON output. `stock` and `compiled` say
    what the baseline is and what --compile compiles."""
    kernels = parser.add_mutually_exclusive_group()
    kernels.add_argument("--use-optimized-kernels", dest="kernels", action="store_true", default=True,
                         help="run on ltx-kernels' layers (default)")
    kernels.add_argument("--no-optimized-kernels", dest="kernels", action="store_false", help=f"{stock} (baseline)")
    parser.add_argument("--compile", action="store_true", help=f"torch.compile {compiled}")
    parser.add_argument("--all", action="store_true", help="baseline, kernels, compile and compile+kernels")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend (\"eager\": dynamo's capture only, for CPU checks)")
    parser.add_argument("--output", type=Path, help="write the results here as JSON")


def selected_configs(args) -> List[str]:
    if args.all:
        return list(CONFIGS)
    if args.kernels:
        return ["compile+kernels" if args.compile else "kernels"]
    return ["compile" if args.compile else "baseline"]


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def finish(args, result: dict, runs) -> dict:
    """Adds the runs to `result`, writes it as JSON where asked; exits 1 if a run failed."""
    result = dict(result, torch=torch.__version__, runs=[asdict(r) for r in runs])
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2))
        print(f"\njson: {args.output}")
    if any(r.error for r in runs):
        raise SystemExit(1)
    return result
