"""End-to-end model benchmarks: whole forwards stock and with ltx-kernels, eager and
compiled.

Workloads (random weights, models built from their configs, bf16):
- LTX-Video transformer, default config (the 2B model; ``--models ltx13b``: the 13B, 48
  layers of 32 heads x 128), batch 2 (CFG), 128 text tokens: 49 frames at 512x768 (latent
  7x16x24 = 2688 tokens) and 161 frames (21x16x24 = 8064); 9 frames (2x16x24 = 768) where
  only the FP8 configurations' error is wanted (minutes a forward on a CPU);
- Qwen3-8B: prefill of 512 and 8192 tokens (batch 1, logits of the last token, as generate
  computes them) and one decode step on a 4096-token KV cache.

Configurations: eager; eager + kernels (the kernel's `kernelize_*`); compile
(`torch.compile(model, fullgraph=True)`); compile + kernels (kernelized with
Mode.INFERENCE | Mode.TORCH_COMPILE, then compiled; a transformers model stays stock there,
see the README; the table marks such a cell "stock"). FP8, for LTX-Video on sm_89+ (not in
the default list): eager / compile + kernels + fp8 (`kernelize_diffusers(fp8=True)`; "+fp8-fast":
with ``fp8_fast_accum=True``), and
eager / compile + torchao-fp8 (torchao's `Float8DynamicActivationFloat8WeightConfig` with
`PerRow()` granularity on a copy of the model, the per-row FP8 a user picks today); their
cells also show the output's relative L2 from eager. A configuration that fails (e.g. a
graph break under fullgraph) is reported with its error rather than stopping the run.

Timing: wall time per forward, CUDA events around each call, after warmup (no CUDA graphs
but with ``--compile-mode reduce-overhead``, where the compiled configurations replay
inductor's CUDA graphs and one whose graphs inductor skipped is reported as an error, not
timed as a graphed forward); the median is reported, with the median host time (until the
call returns) and the queued time (a call of as many calls issued back to back with one
synchronization, as a sampler's steps run: the host's work before a call hidden behind the
GPU's work of the one before; both in parentheses in the table). Each output is compared
with stock eager's (the eager configuration's where it runs first, else one untimed
forward). Also a torch.profiler breakdown of the kernels of one call per model in each
configuration (LTX: the first video; Qwen3: the decode step) with, on a GPU, that
call's timeline (kernels, busy time, span, gaps), a Markdown table, JSON (--json) and a
PNG bar chart (matplotlib, if importable). --clocks also records the SM clock, power and how
often the software power cap held while each configuration was timed (nvidia-smi).

    python -m benchmarks.e2e.e2e_models --json benchmarks/results/e2e_ltx.json   # on a GPU
    python -m benchmarks.e2e.e2e_models --tiny                                  # small models, seconds on CPU
    python -m benchmarks.e2e.e2e_models --models ltx --ltx-videos "49 frames" --fuse-qkv \
        --configs eager,eager+kernels,compile+kernels,eager+kernels+fp8,compile+kernels+fp8,compile+torchao-fp8
    python -m benchmarks.e2e.e2e_models --models ltx13b --ltx-videos "49 frames" --fuse-qkv \
        --configs eager,eager+kernels,eager+kernels+fp8
"""

import argparse
import contextlib
import copy
import hashlib
import json
import platform
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from kernels import Mode, get_local_kernel

from benchmarks import harness

REPO = Path(__file__).resolve().parents[2]

_kernel = get_local_kernel(REPO)  # this checkout's build (torch's backend), with its integration
kernelize_diffusers, kernelize_transformers, unkernelize = (
    _kernel.kernelize_diffusers, _kernel.kernelize_transformers, _kernel.unkernelize)

CONFIGS = ("eager", "eager+kernels", "compile", "compile+kernels")
# torch.compile modes in which inductor records CUDA graphs
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
FP8_CONFIGS = ("eager+kernels+fp8", "compile+kernels+fp8", "eager+kernels+fp8-fast", "compile+kernels+fp8-fast",
               "eager+torchao-fp8", "compile+torchao-fp8")
DTYPE = torch.bfloat16
LTX_TEXT_TOKENS = 128
# latent (frames, height, width) per video length at 512x768 (VAE: 8x temporal, 32x spatial)
LTX_LATENTS = {"9 frames": (2, 16, 24), "49 frames": (7, 16, 24), "161 frames": (21, 16, 24)}
# --models name -> (label, LTX-Video transformer config beside the default, the 2B)
LTX_MODELS = {"ltx": ("LTX-Video", {}),
              "ltx13b": ("LTX-Video 13B", dict(num_layers=48, num_attention_heads=32, attention_head_dim=128,
                                               cross_attention_dim=4096))}
MODELS = (*LTX_MODELS, "qwen3")
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                tie_word_embeddings=False)
QWEN3_PREFILLS = (512, 8192)
QWEN3_DECODE_CACHE = 4096
# --tiny: the same code paths on models and shapes that run in seconds on a CPU.
TINY_LTX = dict(in_channels=16, out_channels=16, num_attention_heads=4, attention_head_dim=16, cross_attention_dim=64,
                num_layers=2, caption_channels=32)
TINY_LTX_LATENTS = {"2 latent frames": (2, 4, 4)}
TINY_QWEN3 = dict(QWEN3_8B, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
TINY_PREFILLS, TINY_DECODE_CACHE = (32,), 64


@dataclass
class Workload:
    model: str  # "ltx" or "qwen3"
    name: str
    run: Callable[[torch.nn.Module], torch.Tensor]  # one forward of the (maybe compiled) model


@dataclass
class Result:
    workload: str
    config: str
    ms: Optional[float] = None
    host_ms: Optional[float] = None  # until the call returns (see median_ms)
    queued_ms: Optional[float] = None  # a call of several issued back to back (see queued_ms)
    max_abs_diff: Optional[float] = None  # vs stock eager's output
    rel_l2: Optional[float] = None  # ||output - eager's|| / ||eager's||
    replaced: Dict[str, int] = field(default_factory=dict)
    error: Optional[str] = None
    clocks: Optional[dict] = None  # --clocks: see clock_summary


def ltx_workloads(model, device, tiny, videos, heavy_tails=False, label="LTX-Video") -> List[Workload]:
    """LTX-Video's forwards; with ``heavy_tails`` the latents and prompt embeddings are drawn
    from Student's t with 2 degrees of freedom (rare values far out, as activations with
    outliers): where per-row FP8 scales lose most."""
    workloads = []
    text = 8 if tiny else LTX_TEXT_TOKENS
    latents = TINY_LTX_LATENTS if tiny else {name: LTX_LATENTS[name] for name in videos}
    for name, (frames, height, width) in latents.items():
        generator = torch.Generator(device).manual_seed(0)
        tokens = frames * height * width

        def draw(*shape):
            if not heavy_tails:
                return torch.randn(*shape, device=device, dtype=DTYPE, generator=generator)
            # t = z / sqrt(chi2_2 / 2), chi2_2 = -2 log(u)
            z = torch.randn(*shape, device=device, generator=generator)
            u = torch.rand(*shape, device=device, generator=generator).clamp(min=1e-12)
            return (z / torch.sqrt(-torch.log(u))).to(DTYPE)
        inputs = dict(
            hidden_states=draw(2, tokens, model.config.in_channels),
            encoder_hidden_states=draw(2, text, model.config.caption_channels),
            timestep=torch.tensor([500, 500], device=device),
            encoder_attention_mask=torch.ones(2, text, device=device),
            num_frames=frames, height=height, width=width, return_dict=False)
        tails = ", heavy-tailed" if heavy_tails else ""
        workloads.append(Workload("ltx", f"{label} {name} ({2 * tokens} tokens{tails})",
                                  lambda m, inputs=inputs: m(**inputs)[0]))
    return workloads


def qwen3_workloads(model, device, tiny) -> List[Workload]:
    vocab = model.config.vocab_size
    workloads = []
    for length in TINY_PREFILLS if tiny else QWEN3_PREFILLS:
        ids = torch.randint(0, vocab, (1, length), device=device)
        workloads.append(Workload("qwen3", f"Qwen3 prefill {length}",
                                  lambda m, ids=ids: m(ids, use_cache=False, logits_to_keep=1).logits))
    cached = TINY_DECODE_CACHE if tiny else QWEN3_DECODE_CACHE
    with torch.no_grad():  # the cache is data: filled once, by the stock model
        cache = model(torch.randint(0, vocab, (1, cached), device=device), use_cache=True,
                      logits_to_keep=1).past_key_values
    token = torch.randint(0, vocab, (1, 1), device=device)

    def decode_step(m):
        logits = m(token, past_key_values=cache, use_cache=True).logits
        cache.crop(-1)  # back to `cached` tokens (views only) for the next step
        return logits

    workloads.append(Workload("qwen3", f"Qwen3 decode step, {cached}-token KV cache", decode_step))
    return workloads


def parameters(model) -> str:
    count = sum(p.numel() for p in model.parameters())
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"


def cudagraph_skips() -> int:
    """Inductor's count of compiled graphs it ran without CUDA graphs (a CPU tensor, an
    input mutation, dynamic shapes...), with the reason in its log."""
    from torch._dynamo.utils import counters
    return counters["inductor"]["cudagraph_skips"]


def median_ms(fn, device, warmup, repeats) -> Tuple[float, float]:
    """Medians of the wall time per call (CUDA events on a GPU) and of the host time, from
    the call until it returns. On a GPU, host time near the wall time means the GPU waited
    for the launches, or the call blocked (a full launch queue, a sync inside it)."""
    for _ in range(warmup):
        fn()
    times, host_times = [], []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()  # the host time starts with an empty launch queue
            start.record()
            start_s = time.perf_counter()
            fn()
            host_times.append((time.perf_counter() - start_s) * 1e3)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
            host_times.append(times[-1])
    return statistics.median(times), statistics.median(host_times)


def queued_ms(fn, device, calls) -> float:
    """Wall time a call of ``calls`` calls issued back to back with one synchronization at the
    end, as a sampler runs its steps: on a GPU the host's work before each call (guards,
    arguments, launches) overlaps the GPU's work of the call before, where the host keeps
    ahead; median_ms's time counts it."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    start_s = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start_s) * 1e3 / calls


class ClockSampler:
    """nvidia-smi's SM clock, power and clock event reasons every 20 ms while the block runs
    (``lines``; none without nvidia-smi). The H200 runs a compiled LTX forward at its software
    power cap, where the SM clock and with it compute-bound kernels such as attention vary."""

    QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"

    def __enter__(self):
        self.lines: List[str] = []
        try:
            command = ["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits", "-lms", "20"]
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except FileNotFoundError:
            self.process = None
            return self
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reader.start()
        return self

    def __exit__(self, *exc):
        if self.process is not None:
            self.process.terminate()
            self.reader.join(timeout=2)


SW_POWER_CAP = 0x4  # nvidia-smi's clock event reason bit


def clock_summary(lines: List[str]) -> Optional[dict]:
    """Samples of ClockSampler's query in, medians and range out; None without samples."""
    samples = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        try:
            samples.append((float(fields[0]), float(fields[1]), int(fields[2], 16)))
        except (ValueError, IndexError):
            continue  # a line cut off by the sampler's end, or "[N/A]"
    if not samples:
        return None
    sm = [s[0] for s in samples]
    return dict(samples=len(samples), sm_mhz_median=statistics.median(sm), sm_mhz_min=min(sm), sm_mhz_max=max(sm),
                power_w_median=statistics.median(s[1] for s in samples),
                power_cap_share=sum(bool(s[2] & SW_POWER_CAP) for s in samples) / len(samples))


def error_text(error: BaseException) -> str:
    """An error as a cell shows it: its type and first line (an empty message too)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def benchmark_model(model, workloads, kernelize, configs, device, timing, compile_options, profiled: Workload,
                    profile_top, clocks=False, on_result: Optional[Callable[[Result], None]] = None
                    ) -> Tuple[List[Result], Dict[str, List[dict]], Dict[str, Optional[dict]]]:
    """Each configuration's times, and (profile_top > 0) the profile_kernels of one call of
    ``profiled`` in it and its GPU timeline, both keyed "workload / config"; ``on_result``
    sees each result as it is made."""
    results, profiles, timelines = [], {}, {}
    # Every configuration's error is from stock eager's output: the eager configuration's
    # where it runs first, else one untimed forward (its failure leaves the errors unset).
    eager_outputs: Dict[str, Optional[torch.Tensor]] = {}
    if configs[0] != "eager":
        unkernelize(model)
        for workload in workloads:
            try:
                with torch.no_grad():
                    eager_outputs[workload.name] = workload.run(model).to(torch.float32, copy=True)
            except Exception as error:  # noqa: BLE001  (the configurations still run)
                eager_outputs[workload.name] = None
                print(f"  {workload.name}: no stock eager output to compare with: {error_text(error)}", flush=True)
    for config in configs:
        unkernelize(model)
        torch._dynamo.reset()  # each configuration compiles its own graphs
        # Compiled configurations kernelize as kernels asks for torch.compile (Mode.TORCH_COMPILE).
        mode = Mode.INFERENCE | Mode.TORCH_COMPILE if config.startswith("compile") else Mode.INFERENCE
        setup_error, target, replaced = None, model, {}
        try:
            if config in FP8_CONFIGS and kernelize is not kernelize_diffusers:
                raise ValueError("the FP8 configurations are for diffusers models (LTX-Video)")
            if "+kernels" in config:
                fp8 = {"fp8": True} if "+fp8" in config else {}
                if config.endswith("+fp8-fast"):
                    fp8["fp8_fast_accum"] = True
                replaced = kernelize(model, mode=mode, **fp8)
            if "torchao-fp8" in config:
                target = torchao_fp8(model)
        except Exception as error:  # noqa: BLE001  (reported per workload below)
            setup_error = error_text(error)
        compiled = config.startswith("compile")
        runner = torch.compile(target, dynamic=False, **compile_options) if compiled else target
        graphed = compiled and compile_options.get("mode") in CUDAGRAPH_MODES
        for workload in workloads:
            result = Result(workload.name, config, replaced=replaced)
            try:
                if setup_error:
                    raise RuntimeError(setup_error)
                with torch.no_grad():
                    skips = cudagraph_skips()
                    output = workload.run(runner).to(torch.float32, copy=True)  # a graph replay reuses its output
                    with ClockSampler() if clocks else contextlib.nullcontext() as sampler:
                        result.ms, result.host_ms = median_ms(lambda: workload.run(runner), device, *timing)
                        result.queued_ms = queued_ms(lambda: workload.run(runner), device, timing[1])
                    if graphed and cudagraph_skips() > skips:
                        raise RuntimeError("inductor ran it without CUDA graphs (its log says why)")
                    result.clocks = clock_summary(sampler.lines) if clocks else None
                if profile_top and workload is profiled:
                    key = f"{workload.name} / {config}"
                    profiles[key], timelines[key] = profile_kernels(lambda: workload.run(runner), device, profile_top)
            except Exception as error:  # noqa: BLE001  (report it and go on with the next configuration)
                result.error = error_text(error)
                print(f"  {workload.name} / {config}: {result.error}", flush=True)
            else:
                eager = eager_outputs.setdefault(workload.name, output) if config == "eager" else \
                    eager_outputs.get(workload.name)
                if eager is not None:
                    result.max_abs_diff = (output - eager).abs().max().item()
                    result.rel_l2 = ((output - eager).norm() / eager.norm()).item()
                l2 = f", L2 {100 * result.rel_l2:.2f}% from eager" \
                    if config in FP8_CONFIGS and result.rel_l2 is not None else ""
                print(f"  {workload.name} / {config}: {result.ms:.2f} ms (host {result.host_ms:.2f} ms, "
                      f"queued {result.queued_ms:.2f} ms){l2}", flush=True)
            results.append(result)
            if on_result:
                on_result(result)
        del runner, target
    unkernelize(model)
    return results, profiles, timelines


def torchao_fp8(model):
    """A copy of ``model`` quantized by torchao's per-row dynamic FP8 (activations and
    weights), on the linears ``kernelize_diffusers(fp8=True)`` converts (the blocks'
    attention and feed-forward), so that the two compare like for like."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    copied = copy.deepcopy(model)
    chosen = {id(linear) for _, _, linear in _kernel.fp8_linear.fp8_plan(copied)}
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    with torchao_on_the_cpu(next(model.parameters()).device):
        quantize_(copied, config, filter_fn=lambda module, name: id(module) in chosen)
    return copied


@contextlib.contextmanager
def torchao_on_the_cpu(device):
    """On the CPU, torchao's FP8 config refuses at its hardware check (a GPU of sm_89 or
    newer), yet its per-row math runs there (torch._scaled_mm's CPU path): lifted for CPU
    models only, so that a CPU run compares the two FP8 paths' errors on the same model."""
    from torchao.quantization import quant_api

    check = getattr(quant_api, "_check_hardware_support", None)
    if device.type != "cpu" or check is None:
        yield
        return
    quant_api._check_hardware_support = lambda granularity: None
    try:
        yield
    finally:
        quant_api._check_hardware_support = check


# Chrome-trace categories of work on the GPU timeline.
DEVICE_TRACE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def profile_kernels(fn, device, top) -> Tuple[List[dict], Optional[dict]]:
    """The ``top`` kernels (CUDA) or ops (CPU) by their own time in one call of ``fn``, and
    on CUDA the call's GPU timeline (see `timeline`)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.no_grad():
        fn()
        with torch.profiler.profile(activities=activities) as profiler:
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
    on_device = device == "cuda"
    events = [e for e in profiler.key_averages()
              if (e.device_type == torch.autograd.DeviceType.CUDA) == on_device
              and (e.self_device_time_total if on_device else e.self_cpu_time_total) > 0]
    us = {e.key: e.self_device_time_total if on_device else e.self_cpu_time_total for e in events}
    total = sum(us.values())
    counts = {e.key: e.count for e in events}
    ranked = sorted(us, key=us.get, reverse=True)[:top]
    rows = [dict(name=name, calls=counts[name], ms=us[name] / 1e3, percent=100 * us[name] / total)
            for name in ranked]
    if not on_device:
        return rows, None
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        trace_events = json.loads(trace.read_text())["traceEvents"]
    return rows, timeline([(e["ts"], e["ts"] + e["dur"]) for e in trace_events
                           if e.get("cat") in DEVICE_TRACE_CATEGORIES])


def timeline(intervals) -> dict:
    """GPU work of one call from its (start, end) intervals in us: how many, the span from
    the first start to the last end, the time some work ran (their union) and the gaps
    (span - busy: launch spacing and waits for the host)."""
    if not intervals:
        return dict(kernels=0, span_ms=0.0, busy_ms=0.0, gaps_ms=0.0)
    ordered = sorted(intervals)
    busy, run_start, run_end = 0.0, *ordered[0]
    for start, end in ordered[1:]:
        if start > run_end:
            busy += run_end - run_start
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    busy += run_end - run_start
    span = run_end - ordered[0][0]  # the last merged run ends last
    return dict(kernels=len(ordered), span_ms=span / 1e3, busy_ms=busy / 1e3, gaps_ms=(span - busy) / 1e3)


def left_stock(r: Result) -> bool:
    """A kernelized configuration whose model kernelize left stock (transformers under
    compile): a second measurement of the configuration without kernels."""
    return "+kernels" in r.config and not r.replaced and r.error is None


def markdown(results: List[Result], configs) -> str:
    by_workload: Dict[str, Dict[str, Result]] = {}
    for r in results:
        by_workload.setdefault(r.workload, {})[r.config] = r
    header = ["workload", *[f"{c} ms (host ms, queued ms)" for c in configs]]
    speedups = [(a, b) for a, b in (("eager+kernels", "eager"), ("compile+kernels", "compile"), ("compile", "eager"),
                                    ("eager+kernels+fp8", "eager"), ("compile+kernels+fp8", "compile"),
                                    ("eager+kernels+fp8-fast", "eager"), ("compile+kernels+fp8-fast", "compile"),
                                    ("compile+torchao-fp8", "compile"))
                if a in configs and b in configs]
    header += [f"{a} vs {b}" for a, b in speedups] + ["max abs diff (kernels)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def cell(r: Optional[Result]) -> str:
        if r is None or r.ms is None:
            return "failed"
        l2 = f" L2 {100 * r.rel_l2:.2f}%" if r.config in FP8_CONFIGS and r.rel_l2 is not None else ""
        queued = f", {r.queued_ms:.2f}" if r.queued_ms is not None else ""
        return f"{r.ms:.2f} ({r.host_ms:.1f}{queued})" + (" stock" if left_stock(r) else "") + l2

    for workload, row in by_workload.items():
        cells = [workload]
        cells += [cell(row.get(c)) for c in configs]
        for a, b in speedups:
            fast, base = row.get(a), row.get(b)
            if fast and left_stock(fast):
                cells.append("stock")  # the same model timed twice: its ratio is noise
                continue
            ok = fast and base and fast.ms and base.ms
            cells.append(f"{base.ms / fast.ms:.2f}x" if ok else "-")
        diffs = [row[c].max_abs_diff for c in configs if c.endswith("+kernels") and row.get(c)
                 and row[c].max_abs_diff is not None]
        cells.append(f"{max(diffs):.2e}" if diffs else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: List[Result], configs, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    workloads = list(dict.fromkeys(r.workload for r in results))
    eager = {r.workload: r.ms for r in results if r.config == "eager" and r.ms}
    fig, ax = plt.subplots(figsize=(2 + 2.2 * len(workloads), 4.5))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        speedups = [next((eager[w] / r.ms for r in results if r.workload == w and r.config == config and r.ms
                          and w in eager), 0.0) for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], speedups, width, label=config)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([x + width * (len(configs) - 1) / 2 for x in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("speedup over eager")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def environment(device) -> dict:
    import diffusers
    import kernels
    import transformers

    try:
        rev = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        rev = None
    return dict(device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, cuda=torch.version.cuda, diffusers=diffusers.__version__,
                transformers=transformers.__version__, kernels=kernels.__version__, git_rev=rev,
                source_sha=source_sha(), peers=harness.library_versions(PEER_PACKAGES))


# The packages beside torch whose code a configuration runs (inductor's Triton, torchao's FP8).
PEER_PACKAGES = ("triton", "torchao")


# What kernel-builder generates into the sources at build time (git-ignored): it names the
# build's git state, not the code.
GENERATED = {"torch-ext/registration.h", "torch-ext/ltx_kernels/_ops.py"}


def source_sha() -> str:
    """The first 12 hex digits of a sha256 over the kernel sources, the Python package and
    the integration module (paths and contents): it names the code a result ran where
    git_rev cannot, in a copied tree whose git metadata lags."""
    files = [p for d in ("kernel_src", "torch-ext") for p in (REPO / d).rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.relative_to(REPO).as_posix() not in GENERATED]
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small models and shapes (seconds on a CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="ltx,qwen3", help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS + FP8_CONFIGS)}")
    parser.add_argument("--ltx-videos", default=",".join(LTX_LATENTS),
                        help=f"comma-separated LTX video lengths, of {', '.join(LTX_LATENTS)}")
    parser.add_argument("--fuse-qkv", action="store_true",
                        help="call diffusers' fuse_qkv_projections() on LTX first (every configuration; the stock "
                             "processor ignores it, the kernelized attention projects q, k, v in one GEMM)")
    parser.add_argument("--heavy-tails", action="store_true",
                        help="LTX inputs from Student's t (2 degrees of freedom) instead of normal: outliers for FP8")
    parser.add_argument("--warmup", type=int, default=None, help="calls before timing (default 3 on a GPU, 1 on CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default 10 on a GPU, 3 on CPU)")
    parser.add_argument("--no-fullgraph", dest="fullgraph", action="store_false", help="allow graph breaks")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend (\"eager\": only dynamo's tracing, to check for graph breaks)")
    parser.add_argument("--compile-mode", default="default",
                        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                        help="torch.compile mode of the compiled configurations (reduce-overhead: inductor's "
                             "CUDA graphs, a forward replayed as one graph)")
    parser.add_argument("--profile-top", type=int, default=15, help="kernels in the profile (0: no profile)")
    parser.add_argument("--clocks", action="store_true",
                        help="sample SM clock, power and the power cap (nvidia-smi) while each configuration is timed")
    parser.add_argument("--json", type=Path, help="write the results here (and the plot beside it, .png)")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS + FP8_CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}")
    videos = [v for v in args.ltx_videos.split(",") if v]
    if not videos or set(videos) - set(LTX_LATENTS):
        parser.error(f"--ltx-videos takes some of {', '.join(LTX_LATENTS)}")
    device = args.device
    compile_options = dict(fullgraph=args.fullgraph, backend=args.compile_backend)
    if args.compile_mode != "default":
        compile_options["mode"] = args.compile_mode
    timing = (args.warmup if args.warmup is not None else (3 if device == "cuda" else 1),
              args.repeats if args.repeats is not None else (10 if device == "cuda" else 3))

    from diffusers import LTXVideoTransformer3DModel
    from diffusers.utils import logging as diffusers_logging
    from transformers import Qwen3Config, Qwen3ForCausalLM

    diffusers_logging.set_verbosity_error()  # its note on casting with .to(dtype) is about fp32 modules it has none of
    results: List[Result] = []  # every result so far, in order

    def report(partial: bool) -> dict:
        return dict(environment=environment(device), tiny=args.tiny, fuse_qkv=args.fuse_qkv,
                    heavy_tails=args.heavy_tails, timing=dict(warmup=timing[0], repeats=timing[1]),
                    compile=compile_options, partial=partial,
                    results=[asdict(r) for r in results], profiles=profiles,
                    timelines=timelines)

    def keep(result: Result) -> None:
        # a run cut short (a device call's time limit) still leaves its results so far
        results.append(result)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report(partial=True), indent=2))

    profiles: Dict[str, List[dict]] = {}  # "workload / config" -> its profile
    timelines: Dict[str, Optional[dict]] = {}  # "workload / config" -> its GPU timeline (None on CPU)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or set(models) - set(MODELS):
        parser.error(f"--models takes some of {', '.join(MODELS)}")
    for name in [m for m in LTX_MODELS if m in models]:
        label, config = LTX_MODELS[name]
        torch.manual_seed(0)
        with torch.device(device):  # random init on the device: seconds, where the CPU takes minutes
            ltx = LTXVideoTransformer3DModel(**(TINY_LTX if args.tiny else config)).to(DTYPE).eval()
        if args.fuse_qkv:
            ltx.fuse_qkv_projections()
        workloads = ltx_workloads(ltx, device, args.tiny, videos, args.heavy_tails, label)
        print(f"{label} transformer: {parameters(ltx)} parameters", flush=True)
        _, model_profiles, model_timelines = benchmark_model(
            ltx, workloads, kernelize_diffusers, configs, device, timing, compile_options, workloads[0],
            args.profile_top, args.clocks, keep)
        profiles.update(model_profiles)
        timelines.update(model_timelines)
        del ltx, workloads
    if "qwen3" in models:
        torch.manual_seed(0)
        with torch.device(device):
            qwen = Qwen3ForCausalLM(Qwen3Config(**(TINY_QWEN3 if args.tiny else QWEN3_8B))).to(DTYPE).eval()
        print(f"Qwen3: {parameters(qwen)} parameters", flush=True)
        workloads = qwen3_workloads(qwen, device, args.tiny)
        # the decode step profiled: where the per-layer small kernels show
        _, model_profiles, model_timelines = benchmark_model(
            qwen, workloads, kernelize_transformers, configs, device, timing, compile_options, workloads[-1],
            args.profile_top, args.clocks, keep)
        profiles.update(model_profiles)
        timelines.update(model_timelines)
        del qwen, workloads

    env = environment(device)
    peers = "".join(f", {name} {version}" for name, version in env["peers"].items() if name != "torch")
    print(f"\n{env['device']}, torch {env['torch']}{peers}, {DTYPE}, median of {timing[1]} after {timing[0]} warmup\n")
    print(markdown(results, configs))
    clocked = [r for r in results if r.clocks]
    if clocked:
        print("\nWhile timed (nvidia-smi every 20 ms):\n")
        print("| workload / config | SM clock MHz, median (min-max) | power W, median | samples at the power cap |")
        print("|---|---|---|---|")
        for r in clocked:
            c = r.clocks
            sm = f"{c['sm_mhz_median']:.0f} ({c['sm_mhz_min']:.0f}-{c['sm_mhz_max']:.0f})"
            print(f"| {r.workload} / {r.config} | {sm} | {c['power_w_median']:.0f} "
                  f"| {100 * c['power_cap_share']:.0f}% of {c['samples']} |")
    for workload_config, profile in profiles.items():
        print(f"\nWhere {workload_config} spends its time (top {len(profile)}):\n")
        print("| kernel | calls | ms | % |\n|---|---|---|---|")
        for row in profile:
            print(f"| {row['name'][:90]} | {row['calls']} | {row['ms']:.3f} | {row['percent']:.1f} |")
        line = timelines.get(workload_config)
        if line:
            print(f"\nGPU timeline of that call: {line['kernels']} kernels, busy {line['busy_ms']:.2f} ms of a "
                  f"{line['span_ms']:.2f} ms span from the first kernel to the last (gaps {line['gaps_ms']:.2f} ms)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report(partial=False), indent=2))
        print(f"\njson: {args.json}")
        plot(results, configs, args.json.with_suffix(".png"))
    return results


if __name__ == "__main__":
    main()
