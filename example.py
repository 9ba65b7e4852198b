"""ltx-kernels on whole models, the way users run them: build an LTX-Video transformer
(diffusers) and a Qwen3 (transformers) from their configs, run each stock and then
kernelized with one call, and print the largest difference and the speedup.

On a GPU the LTX-Video transformer is the real 2B architecture (random weights) at its
49-frame 512x768 shape with CFG (batch 2, 2688 video tokens, 128 text tokens) and the Qwen3
is Qwen3-0.6B's architecture on a 2048-token prompt, all in bf16. Without a GPU both are
small (seconds) and run on the CPU variant.

    ./dev example            # builds first; or: python example.py [--small]
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from diffusers import LTXVideoTransformer3DModel
from diffusers.utils import logging as diffusers_logging
from kernels import get_local_kernel
from transformers import Qwen3Config, Qwen3ForCausalLM

CHECKOUT = Path(__file__).resolve().parent

DTYPE = torch.bfloat16
# (frames, height, width) of the latent video, text tokens
LTX_SHAPE = {"full": ((7, 16, 24), 128), "small": ((2, 4, 6), 16)}
LTX_SMALL_CONFIG = dict(in_channels=16, out_channels=16, num_attention_heads=4, attention_head_dim=32,
                        cross_attention_dim=128, num_layers=2, caption_channels=64)
QWEN3 = {
    "full": (dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  tie_word_embeddings=True), 2048),
    "small": (dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6), 64),
}


def parameters(model) -> str:
    count = sum(p.numel() for p in model.parameters())
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"


def timed_ms(fn, device, warmup, repeats):
    """Median wall time per call after warmup (the median: CPU runs share their cores)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def stock_vs_kernelized(name, model, run, kernelize, device, timing):
    with torch.no_grad():
        expected = run()
        stock_ms = timed_ms(run, device, *timing)
        counts = kernelize(model)
        actual = run()
        ours_ms = timed_ms(run, device, *timing)
    error = (actual.float() - expected.float()).abs().max().item()
    print(f"{name}\n  replaced: {', '.join(f'{n} x{c}' for n, c in sorted(counts.items()))}\n"
          f"  max |kernelized - stock| = {error:.2e} (outputs up to {expected.abs().max().item():.2f})\n"
          f"  stock {stock_ms:.1f} ms, kernelized {ours_ms:.1f} ms per forward ({stock_ms / ours_ms:.2f}x)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the small models on a GPU too")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = "small" if args.small or device == "cpu" else "full"
    # This checkout's build, as get_kernel loads a Hub build: on the GPU the variant of
    # torch's backend, without one the CPU variant. Its integration uses its own layers.
    kernel = get_local_kernel(CHECKOUT, backend=None if device == "cuda" else "cpu")
    timing = (3, 10) if device == "cuda" else (2, 15)
    torch.manual_seed(0)
    diffusers_logging.set_verbosity_error()  # its note on .to(dtype) is about fp32 modules LTX has none of

    (frames, height, width), text_tokens = LTX_SHAPE[size]
    with torch.device(device):  # random init on the GPU: seconds for the 2B model
        ltx = LTXVideoTransformer3DModel(**({} if size == "full" else LTX_SMALL_CONFIG)).to(DTYPE).eval()
    batch, tokens = 2, frames * height * width
    inputs = dict(
        hidden_states=torch.randn(batch, tokens, ltx.config.in_channels, device=device, dtype=DTYPE),
        encoder_hidden_states=torch.randn(batch, text_tokens, ltx.config.caption_channels, device=device, dtype=DTYPE),
        timestep=torch.tensor([500, 500], device=device),
        encoder_attention_mask=torch.ones(batch, text_tokens, device=device),
        num_frames=frames, height=height, width=width, return_dict=False)
    stock_vs_kernelized(
        f"LTX-Video transformer ({parameters(ltx)} parameters, {DTYPE}, "
        f"batch {batch} x {tokens} video tokens + {text_tokens} text tokens, {device})",
        ltx, lambda: ltx(**inputs)[0], kernel.kernelize_diffusers, device, timing)
    del ltx

    config, prompt = QWEN3[size]
    with torch.device(device):
        qwen = Qwen3ForCausalLM(Qwen3Config(**config)).to(DTYPE).eval()
    ids = torch.randint(0, config["vocab_size"], (1, prompt), device=device)
    stock_vs_kernelized(
        f"Qwen3 ({parameters(qwen)} parameters, {DTYPE}, prefill {prompt} tokens, "
        f"{device})",
        qwen, lambda: qwen(ids, use_cache=False).logits, kernel.kernelize_transformers, device, timing)


if __name__ == "__main__":
    main()
