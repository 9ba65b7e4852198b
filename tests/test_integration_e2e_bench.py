"""benchmarks/e2e/e2e_models.py --tiny runs every workload in every configuration on the CPU:
the GPU run exercises no code path CI has not. torch.compile uses dynamo's eager backend
here (fullgraph: no graph break in the stock or the kernelized models, without inductor's
compile time)."""

import importlib
import json
import re

import pytest
import torch

from conftest import REPO

pytest.importorskip("diffusers", reason="requirements-dev.txt installs diffusers")
pytest.importorskip("transformers", reason="requirements-dev.txt installs transformers")


def load_benchmark():
    return importlib.import_module("benchmarks.e2e.e2e_models")


def test_tiny_run_covers_every_workload_and_configuration(tmp_path, capsys):
    bench = load_benchmark()
    out = tmp_path / "e2e.json"
    bench.main(["--tiny", "--device", "cpu", "--compile-backend", "eager", "--warmup", "0", "--repeats", "1",
                "--profile-top", "40", "--clocks", "--json", str(out)])
    report = json.loads(out.read_text())
    results = report["results"]
    workloads = {r["workload"] for r in results}
    assert len(workloads) == 3 and len(results) == 3 * len(bench.CONFIGS)
    for r in results:
        assert r["error"] is None and r["ms"] > 0 and r["host_ms"] > 0 and r["queued_ms"] > 0, r
        # nvidia-smi's samples where it is installed (a GPU machine), else none
        assert r["clocks"] is None or r["clocks"]["samples"] > 0, r
        if r["config"] == "compile+kernels" and r["workload"].startswith("Qwen3"):
            # transformers models stay stock under Mode.TORCH_COMPILE (kernelize_transformers)
            assert r["replaced"] == {} and r["max_abs_diff"] < 5e-2, r
        elif r["config"].endswith("+kernels"):
            assert r["replaced"] and r["max_abs_diff"] < 5e-2, r
        else:
            assert r["replaced"] == {} and r["max_abs_diff"] == 0.0, r
    assert report["compile"] == {"fullgraph": True, "backend": "eager"}
    # the code a result ran, also from a copied tree whose git metadata lags
    source_sha = report["environment"]["source_sha"]
    assert len(source_sha) == 12 and set(source_sha) <= set("0123456789abcdef") and source_sha == bench.source_sha()
    # the peers' versions as installed (torchao's FP8 and inductor's Triton; one not installed left out)
    import importlib.metadata

    want = {"torch": torch.__version__}
    for name in ("triton", "torchao"):
        try:
            want[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    assert report["environment"]["peers"] == want
    ltx, qwen3_decode = results[0]["workload"], results[-1]["workload"]
    profiles = report["profiles"]
    assert set(profiles) == {f"{w} / {c}" for w in (ltx, qwen3_decode) for c in bench.CONFIGS}
    for config in bench.CONFIGS:
        kernelized = config.endswith("+kernels")
        assert any("qk_norm_rope" in row["name"] for row in profiles[f"{ltx} / {config}"]) == kernelized
    assert any("rms_norm" in row["name"] for row in profiles[f"{qwen3_decode} / eager+kernels"])
    assert report["timelines"] == {key: None for key in profiles}  # GPU timelines only
    table = capsys.readouterr().out
    assert ("| workload | eager ms (host ms, queued ms) | eager+kernels ms (host ms, queued ms) "
            "| compile ms (host ms, queued ms) | compile+kernels ms (host ms, queued ms) |") in table
    qwen3_row = next(line for line in table.splitlines() if line.startswith(f"| {qwen3_decode} |"))
    qwen3_cells = qwen3_row.split(" | ")
    assert qwen3_cells[4].endswith(" stock")  # compile+kernels: the stock model compiled
    assert qwen3_cells[6] == "stock"  # and no compile+kernels vs compile ratio
    ltx_row = next(line for line in table.splitlines() if line.startswith(f"| {ltx} |"))
    assert "stock" not in ltx_row


def test_tiny_ltx_with_fused_qkv_projections(tmp_path):
    """--fuse-qkv runs (the fused projections' use is counted in
    test_integration_diffusers.py) and the kernelized outputs still match."""
    bench = load_benchmark()
    out = tmp_path / "e2e.json"
    bench.main(["--tiny", "--device", "cpu", "--models", "ltx", "--configs", "eager,eager+kernels", "--fuse-qkv",
                "--warmup", "0", "--repeats", "1", "--profile-top", "0", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["fuse_qkv"] is True
    kernelized = [r for r in report["results"] if r["config"] == "eager+kernels"]
    assert kernelized and all(r["error"] is None and r["max_abs_diff"] < 5e-2 for r in kernelized), kernelized


def test_a_run_cut_short_leaves_its_results_so_far(tmp_path, monkeypatch):
    """The JSON is written after each result, marked partial until the run ends: a run
    stopped by a time limit (a device call's) keeps what it measured."""
    bench = load_benchmark()
    out = tmp_path / "e2e.json"
    real_unkernelize, calls = bench.unkernelize, []

    def stop_at_the_second_configuration(model):
        calls.append(1)
        if len(calls) == 2:  # eager runs first: its output is the reference, no forward before it
            raise KeyboardInterrupt  # what a timeout's signal amounts to here
        real_unkernelize(model)

    monkeypatch.setattr(bench, "unkernelize", stop_at_the_second_configuration)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--tiny", "--device", "cpu", "--models", "ltx", "--configs", "eager,eager+kernels",
                    "--warmup", "0", "--repeats", "1", "--profile-top", "0", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["partial"] is True
    assert [r["config"] for r in report["results"]] == ["eager"] and report["results"][0]["ms"] > 0
    monkeypatch.setattr(bench, "unkernelize", real_unkernelize)
    bench.main(["--tiny", "--device", "cpu", "--models", "ltx", "--configs", "eager,eager+kernels",
                "--warmup", "0", "--repeats", "1", "--profile-top", "0", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["partial"] is False and [r["config"] for r in report["results"]] == ["eager", "eager+kernels"]


def test_models_are_chosen_by_name(tmp_path):
    """--models ltx13b runs the 13B's workloads under its label (with --tiny, the tiny model
    on the same path); an unknown name is refused, not matched by a substring."""
    bench = load_benchmark()
    results = bench.main(["--tiny", "--device", "cpu", "--models", "ltx13b", "--configs", "eager",
                          "--warmup", "0", "--repeats", "1", "--profile-top", "0"])
    assert [r.workload.split(" 2 latent")[0] for r in results] == ["LTX-Video 13B"], results
    from diffusers import LTXVideoTransformer3DModel

    with torch.device("meta"):  # the 13B's size, without its memory
        big = LTXVideoTransformer3DModel(**bench.LTX_MODELS["ltx13b"][1])
    assert 12.5e9 < sum(p.numel() for p in big.parameters()) < 13.5e9
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--device", "cpu", "--models", "ltx-video", "--configs", "eager"])


def test_tiny_ltx_fp8_configurations(tmp_path, capsys):
    """The FP8 configurations run on the CPU (FP8Linear's reference path), on heavy-tailed
    inputs: converted linears counted, the output's relative L2 from eager recorded and shown;
    torchao's where it is installed, else its import error (or the refusal of row-wise scales
    by some torch releases' CPU torch._scaled_mm) reported in its cells; Qwen3 refused by name."""
    bench = load_benchmark()
    out = tmp_path / "e2e.json"
    configs = ",".join(("eager",) + bench.FP8_CONFIGS)
    bench.main(["--tiny", "--device", "cpu", "--compile-backend", "eager", "--configs", configs,
                "--heavy-tails", "--warmup", "0", "--repeats", "1", "--profile-top", "0", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    by = {(r["workload"].split()[0], r["config"]): r for r in results}
    for config in ("eager+kernels+fp8", "compile+kernels+fp8", "eager+kernels+fp8-fast", "compile+kernels+fp8-fast"):
        r = by[("LTX-Video", config)]
        assert r["error"] is None and r["replaced"]["FP8Linear"] == 20, r
        assert 0 < r["rel_l2"] < 0.05, r
        assert by[("Qwen3", config)]["error"] == \
            "RuntimeError: ValueError: the FP8 configurations are for diffusers models (LTX-Video)"
    for config in ("eager+torchao-fp8", "compile+torchao-fp8"):
        r = by[("LTX-Video", config)]
        assert (r["error"] is None and r["rel_l2"] > 0) or "torchao" in r["error"] \
            or "scale_a.numel() == 1 && scale_b.numel() == 1" in r["error"], r  # cells keep 200 characters
    table = capsys.readouterr().out
    assert "eager+kernels+fp8 vs eager" in table and " L2 " in table
    # each FP8 configuration's line, printed as it finishes, carries its error too
    assert re.search(r"/ compile\+kernels\+fp8: [\d.]+ ms \(host [\d.]+ ms, queued [\d.]+ ms\), L2 [\d.]+% from eager\n",
                     table)


def test_compiled_configuration_inductor_ran_without_cuda_graphs_is_an_error(tmp_path, monkeypatch):
    """--compile-mode reduce-overhead: a compiled configuration during whose calls inductor
    counted a CUDA-graph skip is reported as an error, not timed as a graphed forward; eager
    configurations are timed as ever, and the mode is recorded with the compile options."""
    bench = load_benchmark()
    skips = iter(range(1000))  # a skip counted at every look, as inductor counts each skipped graph
    monkeypatch.setattr(bench, "cudagraph_skips", lambda: next(skips))
    out = tmp_path / "e2e.json"
    bench.main(["--tiny", "--device", "cpu", "--models", "ltx", "--configs", "eager,compile+kernels",
                "--compile-backend", "eager", "--compile-mode", "reduce-overhead", "--warmup", "0",
                "--repeats", "1", "--profile-top", "0", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["compile"]["mode"] == "reduce-overhead"
    by = {r["config"]: r for r in report["results"]}
    assert by["eager"]["error"] is None and by["eager"]["ms"] > 0
    assert by["compile+kernels"]["error"] == "RuntimeError: inductor ran it without CUDA graphs (its log says why)"
    # no skip counted: the graphed configuration is timed
    monkeypatch.setattr(bench, "cudagraph_skips", lambda: 0)
    bench.main(["--tiny", "--device", "cpu", "--models", "ltx", "--configs", "compile+kernels",
                "--compile-backend", "eager", "--compile-mode", "reduce-overhead", "--warmup", "0",
                "--repeats", "1", "--profile-top", "0", "--json", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    assert result["error"] is None and result["ms"] > 0
    # its error is from stock eager's output, though no eager configuration was timed
    assert 0 < result["rel_l2"] < 0.05 and result["max_abs_diff"] > 0, result


def test_a_failing_stock_forward_leaves_the_configurations_running(tmp_path, monkeypatch):
    """Where no eager configuration runs first, the stock eager output is made before the
    configurations; if that forward fails, they are timed as ever, without their errors."""
    bench = load_benchmark()
    real_workloads = bench.ltx_workloads

    def first_call_fails(*args, **kwargs):
        workloads = real_workloads(*args, **kwargs)
        for workload in workloads:
            calls, run = [], workload.run

            def failing(model, calls=calls, run=run):
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("CUDA out of memory (simulated)")
                return run(model)
            workload.run = failing
        return workloads

    monkeypatch.setattr(bench, "ltx_workloads", first_call_fails)
    out = tmp_path / "e2e.json"
    bench.main(["--tiny", "--device", "cpu", "--models", "ltx", "--configs", "eager+kernels,eager",
                "--warmup", "0", "--repeats", "1", "--profile-top", "0", "--json", str(out)])
    by = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    for config in ("eager+kernels", "eager"):
        assert by[config]["error"] is None and by[config]["ms"] > 0, by[config]
        assert by[config]["rel_l2"] is None and by[config]["max_abs_diff"] is None, by[config]


def test_error_text_takes_empty_and_long_messages():
    bench = load_benchmark()
    assert bench.error_text(RuntimeError()) == "RuntimeError: "
    assert bench.error_text(ValueError("\n  first\nsecond")) == "ValueError: first"
    assert bench.error_text(KeyError("x" * 300)) == "KeyError: '" + "x" * 199


def test_timeline_merges_overlapping_work_and_counts_the_gaps():
    """Busy time is the union of the intervals (work on two streams overlaps), the span
    runs from the first start to the last end, whatever the order they come in."""
    bench = load_benchmark()
    # runs [0, 5], [10, 40] (two overlapping) and [45, 50] (one inside another), in us
    line = bench.timeline([(10.0, 30.0), (0.0, 5.0), (20.0, 40.0), (45.0, 50.0), (46.0, 47.0)])
    assert line == pytest.approx(dict(kernels=5, span_ms=0.050, busy_ms=0.040, gaps_ms=0.010))
    assert bench.timeline([]) == dict(kernels=0, span_ms=0.0, busy_ms=0.0, gaps_ms=0.0)


def test_clock_summary_reads_nvidia_smi_samples():
    """clocks.sm, power.draw, clocks_event_reasons.active per line; bit 0x4 is the software
    power cap; lines cut off or not available are skipped."""
    summary = load_benchmark().clock_summary(["1740, 559.20, 0x0000000000000004", "1965, 690.5, 0x0000000000000000",
                                              "1605, 701.0, 0x0000000000000004", "1800, [N/A], 0x0", "17"])
    assert summary == dict(samples=3, sm_mhz_median=1740.0, sm_mhz_min=1605.0, sm_mhz_max=1965.0,
                           power_w_median=690.5, power_cap_share=2 / 3)
    assert load_benchmark().clock_summary([]) is None
