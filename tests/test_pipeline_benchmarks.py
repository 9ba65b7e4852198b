"""The pipeline benchmarks end to end on CPU: benchmarks/e2e/ltx_pipeline.py and
benchmarks/e2e/qwen3_generate.py with --tiny --all (their four configurations), checking the JSON
they write and that the kernelized runs match the baseline.

Compile configurations use `--compile-backend eager`: dynamo captures the whole graph
(fullgraph=True, so a graph break still fails) without inductor's C++ code generation, which
would take minutes on this machine's CPU. No warmup: only correctness is checked here.
"""

import importlib
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ["baseline", "kernels", "compile", "compile+kernels"]
TINY_ARGS = ["--tiny", "--all", "--compile-backend", "eager", "--warmup-iterations", "0", "--device", "cpu"]

pytest.importorskip("diffusers")
pytest.importorskip("transformers")


def load_script(name):
    return importlib.import_module(f"benchmarks.e2e.{name}")


@pytest.fixture(scope="module", autouse=True)
def built_cpu_variant():
    if not list((REPO / "build").glob("*cpu*")):
        pytest.skip("no CPU variant in build/: run `./dev build` first")


def test_ltx_pipeline_tiny_all(tmp_path):
    output = tmp_path / "ltx.json"
    load_script("ltx_pipeline").main([*TINY_ARGS, "--output", str(output)])
    result = json.loads(output.read_text())
    assert result["random_weights"] and result["device"] == "cpu" and result["dtype"] == "bf16"
    assert (result["num_frames"], result["height"], result["width"], result["steps"]) == (9, 64, 64, 3)
    runs = {run["config"]: run for run in result["runs"]}
    assert list(runs) == CONFIGS
    for config, run in runs.items():
        assert run["error"] is None, config
        assert len(run["step_ms"]) == result["steps"]
        assert run["denoise_s"] > 0 and run["decode_s"] > 0 and run["it_per_s"] > 0
        # the decode timed is the whole video: every frame at full resolution
        assert run["video_shape"] == [1, 3, result["num_frames"], result["height"], result["width"]], config
        assert run["speedup_denoise"] > 0 and run["speedup_total"] > 0
        assert bool(run["replaced"]) == config.endswith("kernels"), config
        # bf16 through 3 steps of a random model: the fused layers round differently, no more
        assert run["latents_max_abs_diff"] < 0.1 and run["latents_mean_abs_diff"] < 0.01, config
    assert runs["baseline"]["latents_max_abs_diff"] == 0
    assert runs["kernels"]["replaced"].get("LTXVideoTransformerBlock") == 2


def test_ltx_pipeline_tiny_fused_qkv(tmp_path):
    """--fuse-qkv: every configuration runs on the fused transformer (the kernelized one
    projects through to_qkv: counted in test_integration_diffusers.py), latents as close."""
    output = tmp_path / "ltx.json"
    load_script("ltx_pipeline").main([*TINY_ARGS, "--fuse-qkv", "--output", str(output)])
    result = json.loads(output.read_text())
    assert result["fuse_qkv"] is True
    for run in result["runs"]:
        assert run["error"] is None, run["config"]
        assert run["latents_max_abs_diff"] < 0.1 and run["latents_mean_abs_diff"] < 0.01, run["config"]


def test_ltx_pipeline_tiny_fp8(tmp_path):
    """--fp8: the FP8 configurations run (FP8Linear's CPU path), their latents' relative L2
    from the baseline's recorded: more than the bf16 kernels' (FP8 ran), within a few %."""
    output = tmp_path / "ltx.json"
    load_script("ltx_pipeline").main(["--tiny", "--compile-backend", "eager", "--warmup-iterations", "0", "--device",
                                      "cpu", "--no-optimized-kernels", "--fp8", "--output", str(output)])
    runs = {run["config"]: run for run in json.loads(output.read_text())["runs"]}
    assert list(runs) == ["baseline", "kernels+fp8", "compile+kernels+fp8"]
    assert runs["baseline"]["latents_rel_l2"] == 0 and runs["baseline"]["video_psnr_db"] is None
    for config in ("kernels+fp8", "compile+kernels+fp8"):
        run = runs[config]
        assert run["error"] is None and run["replaced"]["FP8Linear"] == 20, run
        assert 0 < run["latents_rel_l2"] < 0.05, run
        assert run["video_psnr_db"] > 20, run  # the decoded video against the baseline's


def test_qwen3_generate_tiny_all(tmp_path):
    output = tmp_path / "qwen3.json"
    load_script("qwen3_generate").main([*TINY_ARGS, "--output", str(output)])
    result = json.loads(output.read_text())
    assert result["random_weights"] and (result["prompt_tokens"], result["new_tokens"]) == (16, 8)
    runs = {run["config"]: run for run in result["runs"]}
    assert list(runs) == CONFIGS
    for config, run in runs.items():
        assert run["error"] is None, config
        assert run["prefill_ms"] > 0 and run["decode_s"] > 0 and run["decode_tokens_per_s"] > 0
        assert run["peak_memory_gib"] is None  # GPU only
        # transformers models stay stock under Mode.TORCH_COMPILE (kernelize_transformers)
        assert bool(run["replaced"]) == (config == "kernels"), config
        # greedy argmax over 256 logits of a random model: the same tokens, at least nearly all
        assert run["total_tokens"] == 8 and run["matching_tokens"] >= 6, config
        # where a run first differs, the gap between the baseline's top two logits there
        assert (run["reference_margin_at_mismatch"] is None) == (run["first_mismatch"] is None), config
        assert run["reference_margin_at_mismatch"] is None or run["reference_margin_at_mismatch"] >= 0, config
    assert runs["kernels"]["replaced"]["RMSNorm"] == 2 * 4 + 1  # per layer: 2 + q/k norms; final norm


def test_qwen3_generate_records_each_steps_top2_logit_gap():
    import torch

    script = load_script("qwen3_generate")
    args = script.parse_args(["--tiny", "--device", "cpu"])
    model, _ = script.load_model(args, torch.float32)
    prompt = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    tokens, _, _, gaps = script.generate(model, prompt, 4, None, "cpu")
    assert tokens.shape == gaps.shape == (2, 4)
    with torch.no_grad():
        top2 = model(prompt).logits[:, -1].topk(2, dim=-1).values
    torch.testing.assert_close(gaps[:, 0], top2[:, 0] - top2[:, 1])
    assert (gaps >= 0).all()
