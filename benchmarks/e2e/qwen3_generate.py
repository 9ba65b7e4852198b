"""Qwen3 greedy generation, stock and with ltx-kernels, eager and compiled: prefill time,
decode tokens/s, peak GPU memory, and the kernelized run's tokens against the baseline's.

    python -m benchmarks.e2e.qwen3_generate --all --prompt-tokens 512 --new-tokens 128 --output benchmarks/results/qwen3_generate.json
    python -m benchmarks.e2e.qwen3_generate --tiny --all --compile-backend eager     # small model, seconds on CPU

Loading: `AutoModelForCausalLM.from_pretrained(--model)` when the weights can be had;
otherwise (no network) Qwen3-8B's real config with random weights. The prompt is random
token ids of exactly --prompt-tokens (the same for every configuration).

Configurations: baseline, kernels (`kernelize_transformers` after the model is on its
device), compile (`torch.compile(model.forward, fullgraph=True)`, with a static KV cache so
that decode steps keep one shape), compile+kernels (kernelized with Mode.TORCH_COMPILE, which
leaves a transformers model to inductor: see the README, then compiled). Eager runs use
transformers' default dynamic cache.

Timing: one `generate(max_new_tokens=N, do_sample=False)` after --warmup-iterations untimed
ones, with a logits processor reading the clock (synchronized on GPU) at each token: prefill =
from the call to the first token's logits (the forward over the prompt); decode tokens/s =
batch * (N - 1) / (last token's logits - first token's), the N - 1 decode steps.

On CPU, `--compile-backend eager` runs dynamo's tracing without inductor's code generation
(the CPU tests use it).
"""

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
from kernels import get_local_kernel

from benchmarks.e2e.generation_cli import (DTYPES, add_common_arguments, device_name, finish, kernelize_mode,
                                           markdown_table, selected_configs, synchronize)

REPO = Path(__file__).resolve().parents[2]

_kernel = get_local_kernel(REPO)  # this checkout's build (torch's backend), with its integration
kernelize_transformers, unkernelize = _kernel.kernelize_transformers, _kernel.unkernelize

DEFAULT_MODEL = "Qwen/Qwen3-8B"
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                tie_word_embeddings=False)
TINY_QWEN3 = dict(QWEN3_8B, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
TINY_SIZE = dict(prompt_tokens=16, new_tokens=8)


@dataclass
class Run:
    config: str
    prefill_ms: Optional[float] = None
    decode_s: Optional[float] = None  # the new tokens after the first
    decode_tokens_per_s: Optional[float] = None
    peak_memory_gib: Optional[float] = None  # GPU only
    speedup_prefill: Optional[float] = None  # vs baseline
    speedup_decode: Optional[float] = None
    matching_tokens: Optional[int] = None  # new tokens equal to the baseline's, same position
    total_tokens: Optional[int] = None
    first_mismatch: Optional[int] = None  # position of the first differing new token (any row)
    # The reference's gap between its top two logits there (smallest over the rows that
    # differ): a near-tie that any rounding difference flips, as random weights make them.
    reference_margin_at_mismatch: Optional[float] = None
    replaced: Dict[str, int] = field(default_factory=dict)
    error: Optional[str] = None


def load_model(args, dtype):
    """The model and whether its weights are random (built from the config)."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if not args.tiny:
        try:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, device_map=args.device)
            return model.eval(), False
        except Exception as error:  # noqa: BLE001  (any failure to fetch or read the weights: build from config)
            print(f"{args.model} is not available ({type(error).__name__}); using Qwen3-8B's config with random "
                  "weights", flush=True)
    torch.manual_seed(0)
    with torch.device(args.device):  # random init on the device: seconds, where the CPU takes minutes
        model = Qwen3ForCausalLM(Qwen3Config(**(TINY_QWEN3 if args.tiny else QWEN3_8B)))
    return model.to(dtype).eval(), True


def generate(model, prompt, new_tokens: int, cache_len: Optional[int], device: str):
    """One greedy generation of exactly ``new_tokens``, with a static KV cache of
    ``cache_len`` tokens when given: (new token ids, prefill s, decode s, each step's gap
    between its top two logits [batch, new_tokens]). The clock reads at each token's
    logits: the first after the prompt's forward, the last after the last step."""
    from transformers import LogitsProcessorList, StaticCache

    token_times, margins = [], []

    def clock(input_ids, scores):  # a logits processor: runs outside the (compiled) forward
        synchronize(device)
        token_times.append(time.perf_counter())
        top2 = scores.float().topk(2, dim=-1).values
        margins.append(top2[:, 0] - top2[:, 1])
        return scores

    kwargs = {}
    if cache_len:  # a fresh cache of one fixed size each call, so the compiled graphs are reused
        kwargs["past_key_values"] = StaticCache(config=model.config, max_cache_len=cache_len)
    synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        # disable_compile: compiling is this script's choice (--compile), not generate's automatic one
        output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, disable_compile=True,
                                logits_processor=LogitsProcessorList([clock]),
                                pad_token_id=model.config.eos_token_id or 0, **kwargs)
    return (output[:, prompt.shape[1]:], token_times[0] - start, token_times[-1] - token_times[0],
            torch.stack(margins, 1).cpu())


def configure(model, config, args) -> Dict[str, int]:
    """Put the model in ``config``: stock or kernelized, eager or compiled forward. Returns
    the modules the kernels replaced."""
    vars(model).pop("forward", None)  # the previous configuration's compiled forward
    unkernelize(model)
    torch._dynamo.reset()  # each configuration compiles its own graphs
    replaced = kernelize_transformers(model, mode=kernelize_mode(config)) if config.endswith("kernels") else {}
    if config.startswith("compile"):
        model.forward = torch.compile(model.forward, fullgraph=True, backend=args.compile_backend)
    return replaced


def benchmark(model, prompt, args, configs) -> List[Run]:
    runs, baseline_tokens, baseline_margins = [], None, None
    cache_len = prompt.shape[1] + args.new_tokens
    for config in configs:
        run = Run(config)
        print(f"== {config}", flush=True)
        static = cache_len if config.startswith("compile") else None
        try:
            run.replaced = configure(model, config, args)
            for _ in range(args.warmup_iterations):
                generate(model, prompt, args.new_tokens, static, args.device)
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            tokens, prefill_s, decode_s, margins = generate(model, prompt, args.new_tokens, static, args.device)
        except Exception as error:  # noqa: BLE001  (report it and go on with the next configuration)
            run.error = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
            print(f"{config}: {run.error}", flush=True)
            runs.append(run)
            continue
        if args.device == "cuda":
            run.peak_memory_gib = torch.cuda.max_memory_allocated() / 2**30
        run.prefill_ms = prefill_s * 1e3
        run.decode_s = decode_s
        run.decode_tokens_per_s = args.batch_size * (args.new_tokens - 1) / decode_s
        if baseline_tokens is None:  # the first configuration that ran is the reference
            baseline_tokens, baseline_margins = tokens, margins
        matches = tokens == baseline_tokens
        run.matching_tokens, run.total_tokens = int(matches.sum()), matches.numel()
        mismatched = (~matches).any(0).nonzero()
        if len(mismatched):
            run.first_mismatch = int(mismatched[0])
            rows = ~matches[:, run.first_mismatch].cpu()
            run.reference_margin_at_mismatch = float(baseline_margins[rows, run.first_mismatch].min())
        print(f"   prefill {run.prefill_ms:.1f} ms, decode {run.decode_tokens_per_s:.1f} tokens/s, "
              f"{run.matching_tokens}/{run.total_tokens} tokens as the reference", flush=True)
        runs.append(run)
    vars(model).pop("forward", None)
    unkernelize(model)
    reference = next((r for r in runs if r.prefill_ms), None)
    for run in runs:
        if run.prefill_ms and reference:
            run.speedup_prefill = reference.prefill_ms / run.prefill_ms
            run.speedup_decode = run.decode_tokens_per_s / reference.decode_tokens_per_s
    return runs


def table(runs: List[Run]) -> str:
    def cells(r: Run) -> List[str]:
        memory = f"{r.peak_memory_gib:.2f}" if r.peak_memory_gib is not None else "-"
        gap = f"{r.reference_margin_at_mismatch:.3g}" if r.reference_margin_at_mismatch is not None else "-"
        return [f"{r.prefill_ms:.1f}", f"{r.decode_tokens_per_s:.1f}", memory, f"{r.speedup_prefill:.2f}x",
                f"{r.speedup_decode:.2f}x", f"{r.matching_tokens}/{r.total_tokens}", gap]

    return markdown_table(["configuration", "prefill (ms)", "decode (tokens/s)", "peak memory (GiB)",
                           "speedup (prefill)", "speedup (decode)", "tokens as baseline",
                           "baseline's top-2 logit gap at the first difference"], runs, cells)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, stock="stock model", compiled="the forward (fullgraph, static cache)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="local path or Hub id")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--warmup-iterations", type=int, default=2, help="untimed runs before the timed ones")
    parser.add_argument("--tiny", action="store_true",
                        help=f"tiny Qwen3, {TINY_SIZE['prompt_tokens']}-token prompt, {TINY_SIZE['new_tokens']} new "
                             "tokens (CI on CPU)")
    args = parser.parse_args(argv)
    if args.tiny:
        for name, value in TINY_SIZE.items():
            setattr(args, name, value)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode speed is over the tokens after the first)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    configs = selected_configs(args)
    model, random_weights = load_model(args, DTYPES[args.dtype])
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch_size, args.prompt_tokens),
                           generator=generator).to(args.device)
    device = device_name(args.device)
    print(f"{device}, {args.dtype}, batch {args.batch_size}, {args.prompt_tokens}-token prompt, "
          f"{args.new_tokens} new tokens, {'random' if random_weights else 'pretrained'} weights", flush=True)
    runs = benchmark(model, prompt, args, configs)
    print("\n" + table(runs))
    return finish(args, dict(model=args.model, random_weights=random_weights, tiny=args.tiny, device=device,
                             dtype=args.dtype, batch_size=args.batch_size, prompt_tokens=args.prompt_tokens,
                             new_tokens=args.new_tokens, warmup_iterations=args.warmup_iterations,
                             compile_backend=args.compile_backend), runs)


if __name__ == "__main__":
    main()
