"""LTX-Video under diffusers' context parallelism and Qwen3-8B under transformers' tensor
parallelism on several GPUs (one process each, NCCL), stock and kernelized, against one GPU.

    torchrun --nproc-per-node 2 -m benchmarks.e2e.multi_gpu --json benchmarks/results/multi_gpu.json
    torchrun --nproc-per-node 2 -m benchmarks.e2e.multi_gpu --models 13b --repeats 5

Workloads: the LTX-Video transformer, 2B (its default config) and 13B (48 layers, 32 heads
of 128), 161 frames at 512x768 (latent 21x16x24: 8064 tokens), batch 2 (classifier-free
guidance), 128 text tokens without a text mask (diffusers' Ulysses attention splits a mask
with the text tokens it gathers back), bf16, random weights and inputs made on rank 0 and
broadcast. Each rank first runs the whole model alone (stock, then kernelized): the
one-GPU baseline, timed on every GPU at once. Then, for each attention, a copy under
``enable_parallelism(ContextParallelConfig(<attention>_degree=world))``, stock and then
kernelized (`kernelize_diffusers` after enable_parallelism).

Qwen3-8B (``--models qwen3``; from its config, random weights that rank 0 saves once under
``--checkpoint-dir``): ``from_pretrained(tp_plan="auto")``, stock and kernelized
(`kernelize_transformers` after loading), against the whole model on each rank: a prefill
of 8192 tokens and a decode step on a 4096-token cache, the last token's logits compared;
and a training step of a smaller Qwen3 under tp_plan="auto" and under FSDP2, its loss and
grads against one GPU's (``run_qwen3_training``).

Timing: wall time per forward on each rank (CUDA events after a barrier, median of
``--repeats`` after ``--warmup``), the slowest rank's reported. Each output is compared on
rank 0 with the one-GPU output of the same code (stock with stock, kernelized with
kernelized): max abs diff and relative L2. The table gives the speedup over one GPU and,
per attention, the kernels' gain under parallelism beside their one-GPU gain (targets: 13B
Ulysses >= 1.8x over one GPU; the gain under parallelism >= the one-GPU gain - 5%).

``--tiny --device cpu``: a small model on gloo, the test suite's smoke run (it installs
the test-only CPU shims of tests/multi_process_worker.py first).
"""

import argparse
import copy
import datetime
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks.e2e.qwen3_generate import QWEN3_8B, TINY_QWEN3

REPO = Path(__file__).resolve().parents[2]
DTYPE = torch.bfloat16
CONFIGS = {"2b": {}, "13b": dict(num_layers=48, num_attention_heads=32, attention_head_dim=128,
                                  cross_attention_dim=4096)}
LATENT = (21, 16, 24)  # 161 frames at 512x768
TEXT_TOKENS = 128
TINY = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=16, cross_attention_dim=64,
            num_layers=2, caption_channels=32)
TINY_LATENT, TINY_TEXT = (2, 3, 4), 8
ATTENTIONS = ("ulysses", "ring")
PREFILL, DECODE_CACHE = 8192, 4096
TINY_PREFILL, TINY_DECODE_CACHE = 32, 16


@dataclass
class Row:
    model: str
    setup: str  # "1 GPU" or the attention
    config: str  # "stock" or "kernelized"
    ms: Optional[float] = None
    max_abs_diff: Optional[float] = None  # vs one GPU running the same code
    rel_l2: Optional[float] = None
    replaced: Optional[Dict[str, int]] = None
    error: Optional[str] = None


def build(name: str, tiny: bool, device: torch.device):
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    with torch.device(device):
        model = LTXVideoTransformer3DModel(**(TINY if tiny else CONFIGS[name])).to(DTYPE).eval()
    with torch.no_grad():
        for p in model.parameters():  # random everywhere (the zero-initialised too), rank 0's
            p.normal_(0.0, 0.5 / max(p.shape[-1], 1) ** 0.5 if p.dim() > 1 else 0.1)
            dist.broadcast(p, 0)
    return model


def make_inputs(model, tiny: bool, device: torch.device) -> dict:
    frames, height, width = TINY_LATENT if tiny else LATENT
    text = TINY_TEXT if tiny else TEXT_TOKENS
    generator = torch.Generator(device).manual_seed(1)
    hidden = torch.randn(2, frames * height * width, model.config.in_channels, device=device, dtype=DTYPE,
                         generator=generator)
    encoder = torch.randn(2, text, model.config.caption_channels, device=device, dtype=DTYPE, generator=generator)
    for t in (hidden, encoder):
        dist.broadcast(t, 0)
    return dict(hidden_states=hidden, encoder_hidden_states=encoder, timestep=torch.tensor([500, 500], device=device),
                encoder_attention_mask=None, num_frames=frames, height=height, width=width, return_dict=False)


def timed(model, inputs, device, warmup: int, repeats: int, grad: bool = False):
    """The output and the slowest rank's median ms per call (``grad``: with autograd on, for
    training steps)."""
    with torch.enable_grad() if grad else torch.no_grad():
        out = model(**inputs)[0]
        out = out.full_tensor() if hasattr(out, "full_tensor") else out  # a DTensor under tensor parallelism
        for _ in range(warmup):
            model(**inputs)
        times = []
        for _ in range(repeats):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(**inputs)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                start_s = time.perf_counter()
                model(**inputs)
                times.append((time.perf_counter() - start_s) * 1e3)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return out.float(), slowest.item()


def compare(row: Row, out: torch.Tensor, reference: torch.Tensor) -> None:
    row.max_abs_diff = (out - reference).abs().max().item()
    row.rel_l2 = ((out - reference).norm() / reference.norm()).item()


def run_model(name, lki, tiny, device, warmup, repeats, world) -> List[Row]:
    from diffusers import ContextParallelConfig

    rows, one_gpu = [], {}
    base = build(name, tiny, device)
    inputs = make_inputs(base, tiny, device)
    for config in ("stock", "kernelized"):
        row = Row(name, "1 GPU", config)
        row.replaced = lki.kernelize_diffusers(base) if config == "kernelized" else {}
        one_gpu[config], row.ms = timed(base, inputs, device, warmup, repeats)
        lki.unkernelize(base)
        rows.append(row)
    for attention in ATTENTIONS:
        model = copy.deepcopy(base)
        try:
            model.enable_parallelism(config=ContextParallelConfig(**{f"{attention}_degree": world}))
        except Exception as error:  # noqa: BLE001  (reported, the next attention runs)
            rows += [Row(name, attention, c, error=f"{type(error).__name__}: {str(error)[:200]}")
                     for c in ("stock", "kernelized")]
            continue
        for config in ("stock", "kernelized"):
            row = Row(name, attention, config)
            try:
                row.replaced = lki.kernelize_diffusers(model) if config == "kernelized" else {}
                out, row.ms = timed(model, inputs, device, warmup, repeats)
                compare(row, out, one_gpu[config])
            except Exception as error:  # noqa: BLE001
                row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            rows.append(row)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del base
    return rows


def run_qwen3(lki, tiny, device, warmup, repeats, checkpoint: Path) -> List[Row]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = checkpoint / ("qwen3-tiny" if tiny else "qwen3-8b")
    if dist.get_rank() == 0 and not (path / "config.json").exists():
        torch.manual_seed(0)
        with torch.device(device):
            Qwen3ForCausalLM(Qwen3Config(**(TINY_QWEN3 if tiny else QWEN3_8B))).to(DTYPE).save_pretrained(path)
    dist.barrier()
    vocab = (TINY_QWEN3 if tiny else QWEN3_8B)["vocab_size"]
    generator = torch.Generator(device).manual_seed(1)
    prefill_ids = torch.randint(0, vocab, (1, TINY_PREFILL if tiny else PREFILL), device=device, generator=generator)
    cache_ids = torch.randint(0, vocab, (1, TINY_DECODE_CACHE if tiny else DECODE_CACHE), device=device,
                              generator=generator)
    token = torch.randint(0, vocab, (1, 1), device=device, generator=generator)
    for t in (prefill_ids, cache_ids, token):
        dist.broadcast(t, 0)
    rows, one_gpu = [], {}

    def workloads(model):
        with torch.no_grad():
            cache = model(cache_ids, use_cache=True, logits_to_keep=1).past_key_values

        def decode(**_):
            logits = model(token, past_key_values=cache, use_cache=True).logits
            cache.crop(-1)
            return (logits,)
        return {"prefill": lambda **_: (model(prefill_ids, use_cache=False, logits_to_keep=1).logits,),
                "decode": decode}

    for setup, loading in (("1 GPU", dict(device_map=device)), ("tensor parallel", dict(tp_plan="auto"))):
        for config in ("stock", "kernelized"):
            model = Qwen3ForCausalLM.from_pretrained(path, dtype=DTYPE, **loading).eval()
            replaced = lki.kernelize_transformers(model) if config == "kernelized" else {}
            for name, call in workloads(model).items():
                row = Row(f"qwen3 {name}", setup, config, replaced=replaced)
                try:
                    out, row.ms = timed(call, {}, device, warmup, repeats)
                    if setup == "1 GPU":
                        one_gpu[name, config] = out
                    else:
                        compare(row, out, one_gpu[name, config])
                except Exception as error:  # noqa: BLE001
                    row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                rows.append(row)
            del model, call  # the decode closure holds the model too
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def run_qwen3_training(lki, tiny, device, warmup, repeats, checkpoint: Path) -> List[Row]:
    """A training step (forward, loss, backward) of a smaller Qwen3 (0.5B: 8 layers, 1024
    wide) on a batch of 2 x 1024 tokens, alone on each rank, under tp_plan="auto" and under
    FSDP2 (each decoder layer and the model fully_shard-ed; every rank the same batch, so the
    averaged grads are one GPU's), stock and kernelized (Mode.TRAINING). max_abs_diff: the
    loss against one GPU's; rel_l2: the worst parameter grad's."""
    from kernels import Mode
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = TINY_QWEN3 if tiny else dict(QWEN3_8B, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                                          num_attention_heads=16, num_key_value_heads=8, head_dim=64)
    path = checkpoint / ("qwen3-train-tiny" if tiny else "qwen3-train")
    if dist.get_rank() == 0 and not (path / "config.json").exists():
        torch.manual_seed(0)
        with torch.device(device):
            Qwen3ForCausalLM(Qwen3Config(**config)).to(DTYPE).save_pretrained(path)
    dist.barrier()
    ids = torch.randint(0, config["vocab_size"], (2, 16 if tiny else 1024), device=device,
                        generator=torch.Generator(device).manual_seed(2))
    dist.broadcast(ids, 0)

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).float()

    def fsdp(model):
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    setups = {"1 GPU": (dict(device_map=device), None), "tensor parallel": (dict(tp_plan="auto"), None),
              "FSDP2": (dict(device_map=device), fsdp)}
    rows, one_gpu = [], {}
    for setup, (loading, parallelize) in setups.items():
        for kind in ("stock", "kernelized"):
            row = Row("qwen3 training step", setup, kind)
            try:
                model = Qwen3ForCausalLM.from_pretrained(path, dtype=DTYPE, **loading).train()
                row.replaced = lki.kernelize_transformers(model, mode=Mode.TRAINING) if kind == "kernelized" else {}
                if parallelize is not None:
                    model = parallelize(model)

                def step(**_):
                    model.zero_grad(set_to_none=True)
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    return (loss.detach(),)
                loss, row.ms = timed(step, {}, device, warmup, repeats, grad=True)
                grads = {n.replace("_orig_mod.", ""): full(p.grad) for n, p in model.named_parameters()
                         if p.grad is not None}
                if setup == "1 GPU":
                    one_gpu[kind] = loss, grads
                else:
                    want_loss, want_grads = one_gpu[kind]
                    row.max_abs_diff = (loss - want_loss).abs().item()
                    row.rel_l2 = max(((g - want_grads[n]).norm() / want_grads[n].norm().clamp(min=1e-12)).item()
                                     for n, g in grads.items())
                del model, step, grads
            except Exception as error:  # noqa: BLE001
                row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def markdown(rows: List[Row], world: int) -> str:
    lines = [f"| model | setup | stock ms | kernelized ms | kernels' gain | stock vs 1 GPU | kernelized vs 1 GPU "
             f"| kernelized max abs diff / rel L2 vs 1 GPU |", "|---|---|---|---|---|---|---|---|"]
    by = {(r.model, r.setup, r.config): r for r in rows}
    for model in dict.fromkeys(r.model for r in rows):
        one = {c: by.get((model, "1 GPU", c)) for c in ("stock", "kernelized")}
        for setup in ("1 GPU", *ATTENTIONS, "tensor parallel", "FSDP2"):
            stock, ours = by.get((model, setup, "stock")), by.get((model, setup, "kernelized"))
            if stock is None:
                continue

            def ms(r):
                return f"{r.ms:.1f}" if r and r.ms else (f"failed: {r.error}" if r else "-")

            def ratio(a, b):
                return f"{a.ms / b.ms:.2f}x" if a and b and a.ms and b.ms else "-"
            diff = f"{ours.max_abs_diff:.2e} / {100 * ours.rel_l2:.3f}%" if ours and ours.rel_l2 is not None else "-"
            lines.append(f"| {model} | {setup} | {ms(stock)} | {ms(ours)} | {ratio(stock, ours)} "
                         f"| {ratio(one['stock'], stock) if setup != '1 GPU' else '-'} "
                         f"| {ratio(one['kernelized'], ours) if setup != '1 GPU' else '-'} | {diff} |")
    return "\n".join(lines) + f"\n\n{world} ranks; times: the slowest rank's median."


def main(argv=None) -> List[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="2b,13b,qwen3", help="comma-separated: 2b, 13b (LTX-Video), qwen3")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/ltx_multi_gpu"),
                        help="where rank 0 saves the random Qwen3 checkpoint tp_plan loads")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a small model and shapes (the CPU smoke run)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="rank 0 writes the rows here (and the Markdown beside it, .md)")
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        import sys

        sys.path.insert(0, str(REPO / "tests"))
        from multi_process_worker import cpu_shims

        cpu_shims()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))
    from diffusers.utils import logging as diffusers_logging
    from kernels import get_local_kernel

    diffusers_logging.set_verbosity_error()
    lki = get_local_kernel(REPO)
    rows: List[Row] = []
    try:
        models = [m for m in args.models.split(",") if m]
        for name in ["tiny"] if args.tiny else [m for m in models if m != "qwen3"]:
            rows += run_model(name, lki, args.tiny, device, args.warmup, args.repeats, world)
        if "qwen3" in models:
            rows += run_qwen3(lki, args.tiny, device, args.warmup, args.repeats, args.checkpoint_dir)
            rows += run_qwen3_training(lki, args.tiny, device, args.warmup, args.repeats, args.checkpoint_dir)
    finally:
        if rank == 0:
            table = markdown(rows, world)
            print(table, flush=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                import diffusers

                env = dict(world=world, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           torch=torch.__version__, diffusers=diffusers.__version__, tiny=args.tiny,
                           warmup=args.warmup, repeats=args.repeats)
                args.json.write_text(json.dumps(dict(environment=env, rows=[asdict(r) for r in rows]), indent=2))
                args.json.with_suffix(".md").write_text(table + "\n")
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
