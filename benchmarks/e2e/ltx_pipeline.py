"""Whole LTX-Video generation (denoising loop + VAE decode), stock and with ltx-kernels,
eager and compiled: the command behind the seed's end-to-end numbers.

    python -m benchmarks.e2e.ltx_pipeline --all --num-frames 49 --steps 30 --output benchmarks/results/ltx_pipeline.json
    python -m benchmarks.e2e.ltx_pipeline --tiny --all --compile-backend eager      # small models, seconds on CPU
    python -m benchmarks.e2e.ltx_pipeline --all --fp8 --torchao-fp8 --num-frames 49 --steps 30 --fuse-qkv

Loading: `LTXPipeline.from_pretrained(--model)` when the weights can be had; otherwise (no
network, as on our machines) the same pipeline built from configs with random weights: the
2B transformer (`LTXVideoTransformer3DModel()` defaults), the video VAE
(`AutoencoderKLLTXVideo()` defaults), LTX-Video's FlowMatch scheduler settings, and random
prompt embeddings of the T5 shape [B, 128, 4096] in place of the text encoder. The work timed
is the same as with real weights. With real weights the prompt is encoded once, up front.

Configurations: baseline, kernels (`kernelize_diffusers` after `.to(device)`, before any
offload hooks), compile (`torch.compile(transformer, fullgraph=True)`), compile+kernels
(kernelized, then compiled). Each runs --warmup-iterations untimed generations, then one
timed: denoising per step (a step callback, synchronized on GPU) and in total, then the VAE
decode of the final latents. Every run starts from the same seed; the final latents of each
configuration are compared with the baseline's (max and mean abs diff, relative L2).
FP8 (sm_89+ on CUDA): `--fp8` adds kernels+fp8 and compile+kernels+fp8
(`kernelize_diffusers(fp8=True)`), `--torchao-fp8` adds torchao-fp8 and compile+torchao-fp8
(torchao's per-row FP8 on a copy of the transformer), for their speed and their latents'
distance from the baseline's.

On CPU, `--compile-backend eager` runs dynamo's tracing without inductor's code generation
(the CPU tests use it: the same fullgraph capture, in seconds).
"""

import argparse
import math
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
kernelize_diffusers, unkernelize = _kernel.kernelize_diffusers, _kernel.unkernelize

DEFAULT_MODEL = "Lightricks/LTX-Video"
PROMPT = "A red fox trots through fresh snow in a birch forest at dawn, soft light, slow camera pan."
T5_TOKENS, T5_WIDTH = 128, 4096
# LTX-Video's scheduler_config (resolution-dependent shift, as the pipeline computes `mu`).
LTX_SCHEDULER = dict(base_image_seq_len=1024, max_image_seq_len=4096, base_shift=0.95, max_shift=2.05,
                     shift_terminal=0.1, use_dynamic_shifting=True)
# --tiny: the same pipeline code on models that run in seconds on a CPU.
TINY_TRANSFORMER = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                        cross_attention_dim=32, num_layers=2, caption_channels=32)
TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
                decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                decoder_layers_per_block=(1, 1, 1, 1, 1))
TINY_TEXT = (16, 32)  # tokens, width of the random prompt embeddings
TINY_SIZE = dict(num_frames=9, height=64, width=64, steps=3)


@dataclass
class Run:
    config: str
    denoise_s: Optional[float] = None
    step_ms: List[float] = field(default_factory=list)
    it_per_s: Optional[float] = None
    decode_s: Optional[float] = None
    video_shape: List[int] = field(default_factory=list)  # decoded [B, C, frames, height, width]
    total_s: Optional[float] = None
    speedup_denoise: Optional[float] = None  # vs baseline
    speedup_total: Optional[float] = None
    latents_max_abs_diff: Optional[float] = None  # final latents vs baseline's
    latents_mean_abs_diff: Optional[float] = None
    latents_rel_l2: Optional[float] = None
    video_psnr_db: Optional[float] = None  # decoded video vs baseline's ([-1, 1]: peak 2); None where equal
    replaced: Dict[str, int] = field(default_factory=dict)
    error: Optional[str] = None


def load_pipeline(args, dtype):
    """The pipeline and whether its weights are random (built from configs)."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, \
        LTXVideoTransformer3DModel

    if not args.tiny:
        try:
            return LTXPipeline.from_pretrained(args.model, torch_dtype=dtype), False
        except Exception as error:  # noqa: BLE001  (any failure to fetch or read the weights: build from configs)
            print(f"{args.model} is not available ({type(error).__name__}); using random weights from configs",
                  flush=True)
    torch.manual_seed(0)
    with torch.device(args.device):  # random init on the device: seconds, where the CPU takes minutes
        # eval(), as from_pretrained leaves them (kernelize_diffusers(fp8=True) refuses training mode)
        transformer = LTXVideoTransformer3DModel(**(TINY_TRANSFORMER if args.tiny else {})).eval()
        vae = AutoencoderKLLTXVideo(**(TINY_VAE if args.tiny else {})).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**LTX_SCHEDULER)
    pipe = LTXPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer)
    return pipe.to(dtype=dtype), True


def prompt_embeddings(pipe, args, dtype, random_weights) -> dict:
    """`prompt_embeds` / `negative_prompt_embeds` and their masks for a batch of
    --batch-size videos: encoded once with a real text encoder, else random of T5's shape."""
    batch = args.batch_size
    if not random_weights:
        embeds, mask, negative, negative_mask = pipe.encode_prompt(
            [PROMPT] * batch, negative_prompt=[""] * batch, device=args.device, dtype=dtype)
        pipe.text_encoder.to("cpu")  # not needed again: free its memory for the transformer
        return dict(prompt_embeds=embeds, prompt_attention_mask=mask, negative_prompt_embeds=negative,
                    negative_prompt_attention_mask=negative_mask)
    tokens, width = TINY_TEXT if args.tiny else (T5_TOKENS, T5_WIDTH)
    generator = torch.Generator(args.device).manual_seed(1)

    def random_embeds():
        return torch.randn(batch, tokens, width, generator=generator, device=args.device, dtype=dtype)

    mask = torch.ones(batch, tokens, device=args.device, dtype=torch.long)
    return dict(prompt_embeds=random_embeds(), prompt_attention_mask=mask, negative_prompt_embeds=random_embeds(),
                negative_prompt_attention_mask=mask.clone())


def decode(pipe, latents, args):
    """The pipeline's own decode of its packed output latents (what it does after the loop)."""
    latent_frames = (args.num_frames - 1) // pipe.vae_temporal_compression_ratio + 1
    latent_height = args.height // pipe.vae_spatial_compression_ratio
    latent_width = args.width // pipe.vae_spatial_compression_ratio
    latents = pipe._unpack_latents(latents, latent_frames, latent_height, latent_width,
                                   pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
    latents = pipe._denormalize_latents(latents, pipe.vae.latents_mean, pipe.vae.latents_std,
                                        pipe.vae.config.scaling_factor)
    timestep = None
    if pipe.vae.config.timestep_conditioning:  # decode_timestep 0, as the pipeline's default
        timestep = torch.zeros(latents.shape[0], device=latents.device, dtype=latents.dtype)
    return pipe.vae.decode(latents.to(pipe.vae.dtype), timestep, return_dict=False)[0]


def generate(pipe, args, embeddings):
    """One generation: (final latents, per-step ms, denoise s, decode s, decoded video)."""
    step_ends = []

    def on_step_end(pipeline, step, timestep, tensors):
        synchronize(args.device)
        step_ends.append(time.perf_counter())
        return {}

    generator = torch.Generator(args.device).manual_seed(args.seed)
    synchronize(args.device)
    start = time.perf_counter()
    with torch.no_grad():
        latents = pipe(num_frames=args.num_frames, height=args.height, width=args.width,
                       num_inference_steps=args.steps, generator=generator, output_type="latent",
                       return_dict=False, callback_on_step_end=on_step_end, **embeddings)[0]
        synchronize(args.device)
        denoised = time.perf_counter()
        video = decode(pipe, latents, args)
        synchronize(args.device)
    decoded = time.perf_counter()
    steps = [start, *step_ends]
    step_ms = [(b - a) * 1e3 for a, b in zip(steps, steps[1:])]
    return latents.float(), step_ms, denoised - start, decoded - denoised, video


def configure(pipe, transformer, config, args) -> Dict[str, int]:
    """Put the pipeline in ``config``: stock or kernelized transformer, eager or compiled,
    offload hooks last. Returns the modules the kernels replaced."""
    pipe.remove_all_hooks()  # offload hooks of the previous configuration; kernelize refuses them
    pipe.transformer = transformer
    pipe.to(args.device)
    unkernelize(transformer)
    torch._dynamo.reset()  # each configuration compiles its own graphs
    fp8 = {"fp8": True} if config.endswith("+fp8") else {}
    replaced = kernelize_diffusers(pipe, mode=kernelize_mode(config), **fp8) if "kernels" in config else {}
    if "torchao-fp8" in config:
        from benchmarks.e2e.e2e_models import torchao_fp8

        pipe.transformer = torchao_fp8(transformer)
    if config.startswith("compile"):
        pipe.transformer = torch.compile(pipe.transformer, fullgraph=True, backend=args.compile_backend)
    if args.cpu_offload:
        pipe.enable_model_cpu_offload(device=args.device)
    return replaced


def benchmark(pipe, args, embeddings, configs) -> List[Run]:
    transformer = pipe.transformer
    runs, baseline_latents, baseline_video = [], None, None
    for config in configs:
        run = Run(config)
        print(f"\n== {config}", flush=True)
        try:
            run.replaced = configure(pipe, transformer, config, args)
            for _ in range(args.warmup_iterations):
                generate(pipe, args, embeddings)
            latents, run.step_ms, run.denoise_s, run.decode_s, video = generate(pipe, args, embeddings)
            run.video_shape = list(video.shape)
        except Exception as error:  # noqa: BLE001  (report it and go on with the next configuration)
            run.error = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
            print(f"{config}: {run.error}", flush=True)
            runs.append(run)
            continue
        run.it_per_s = args.steps / run.denoise_s
        run.total_s = run.denoise_s + run.decode_s
        if baseline_latents is None:  # the first configuration that ran is the reference
            baseline_latents, baseline_video = latents, video.float()
        difference = (latents - baseline_latents).abs()
        run.latents_max_abs_diff, run.latents_mean_abs_diff = difference.max().item(), difference.mean().item()
        run.latents_rel_l2 = (difference.float().norm() / baseline_latents.float().norm()).item()
        mse = (video.float() - baseline_video).square().mean().item()
        run.video_psnr_db = 10 * math.log10(4 / mse) if mse > 0 else None
        del video
        runs.append(run)
    pipe.remove_all_hooks()
    pipe.transformer = transformer
    unkernelize(transformer)
    reference = next((r for r in runs if r.denoise_s), None)
    for run in runs:
        if run.denoise_s and reference:
            run.speedup_denoise = reference.denoise_s / run.denoise_s
            run.speedup_total = reference.total_s / run.total_s
    return runs


def table(runs: List[Run]) -> str:
    def cells(r: Run) -> List[str]:
        median_step = sorted(r.step_ms)[len(r.step_ms) // 2]
        return [f"{r.denoise_s:.3f}", f"{r.it_per_s:.2f}", f"{median_step:.1f}", f"{r.decode_s:.3f}",
                f"{r.total_s:.3f}", f"{r.speedup_denoise:.2f}x", f"{r.speedup_total:.2f}x",
                f"{r.latents_max_abs_diff:.2e} / {r.latents_mean_abs_diff:.2e}", f"{100 * r.latents_rel_l2:.2f}%",
                "-" if r.video_psnr_db is None else f"{r.video_psnr_db:.1f}"]

    return markdown_table(["configuration", "denoise (s)", "it/s", "median step (ms)", "VAE decode (s)", "total (s)",
                           "speedup (denoise)", "speedup (total)", "latents max / mean abs diff", "latents rel L2",
                           "video PSNR dB"],
                          runs, cells)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, stock="stock diffusers transformer", compiled="the transformer (fullgraph)")
    parser.add_argument("--batch-size", type=int, default=1, help="videos per prompt")
    parser.add_argument("--num-frames", type=int, default=161)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--steps", type=int, default=50, help="denoising steps")
    parser.add_argument("--warmup-iterations", type=int, default=2, help="untimed generations before the timed one")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="local path or Hub id of a diffusers LTX-Video repo")
    parser.add_argument("--cpu-offload", action="store_true", help="enable_model_cpu_offload (needs accelerate)")
    parser.add_argument("--fuse-qkv", action="store_true",
                        help="diffusers' transformer.fuse_qkv_projections() first (every configuration: the stock "
                             "processor ignores it, the kernelized attention projects q, k, v in one GEMM)")
    parser.add_argument("--fp8", action="store_true", help="also kernels+fp8 and compile+kernels+fp8")
    parser.add_argument("--torchao-fp8", action="store_true",
                        help="also torchao-fp8 and compile+torchao-fp8 (needs torchao)")
    parser.add_argument("--tiny", action="store_true",
                        help=f"tiny transformer and VAE, {TINY_SIZE['num_frames']} frames at "
                             f"{TINY_SIZE['height']}x{TINY_SIZE['width']}, {TINY_SIZE['steps']} steps (CI on CPU)")
    args = parser.parse_args(argv)
    if args.tiny:
        for name, value in TINY_SIZE.items():
            setattr(args, name, value)
    if args.cpu_offload:
        from diffusers.utils import is_accelerate_available

        if not is_accelerate_available():
            parser.error("--cpu-offload uses enable_model_cpu_offload, which needs accelerate: pip install accelerate")
        if args.device == "cpu":
            parser.error("--cpu-offload offloads to the CPU from a GPU; it needs --device cuda")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    configs = selected_configs(args)
    configs += ["kernels+fp8", "compile+kernels+fp8"] if args.fp8 else []
    configs += ["torchao-fp8", "compile+torchao-fp8"] if args.torchao_fp8 else []

    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # keep the output to the progress bars and the results
    pipe, random_weights = load_pipeline(args, dtype)
    pipe.to(args.device)
    if args.fuse_qkv:
        pipe.transformer.fuse_qkv_projections()
    embeddings = prompt_embeddings(pipe, args, dtype, random_weights)
    device = device_name(args.device)
    print(f"{device}, {args.dtype}, {args.width}x{args.height}, {args.num_frames} frames, {args.steps} steps, "
          f"batch {args.batch_size}, {'random' if random_weights else 'pretrained'} weights, "
          f"{args.warmup_iterations} warmup generation(s)", flush=True)
    runs = benchmark(pipe, args, embeddings, configs)
    print("\n" + table(runs))
    return finish(args, dict(model=args.model, random_weights=random_weights, tiny=args.tiny, device=device,
                             dtype=args.dtype, width=args.width, height=args.height, num_frames=args.num_frames,
                             steps=args.steps, batch_size=args.batch_size, warmup_iterations=args.warmup_iterations,
                             cpu_offload=args.cpu_offload, fuse_qkv=args.fuse_qkv,
                             compile_backend=args.compile_backend), runs)


if __name__ == "__main__":
    main()
