"""bench_ops times only what computes the op: an implementation whose error sets it apart
from every other is skipped as wrong, and a wrong ltx fails the run (its report written).
The launch-tuning harnesses (rope_variants.cu and norm_variants.cu, built on their
kernels' headers) still compile, spill-free, for every arch the package targets."""

import json
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from benchmarks import harness
from benchmarks.ops import bench_ops
from benchmarks.tuning import variants_build

REPO = Path(__file__).resolve().parents[1]


def test_wrong_results_flags_only_the_outlier():
    # fp32 8192x65536 of a build whose kernel covered half of each row (H200)
    errors = {"eager": 2.4e-7, "compile": 1.2e-6, "F.rms_norm": 1.3e-6, "liger": 1.3e-6, "ltx": 2.69}
    assert set(bench_ops.wrong_results(errors)) == {"ltx"}
    # adaln_layer [2,21504,2048]: the eager code's own roundings, 3.9x the others', are not wrong
    assert bench_ops.wrong_results({"eager": 0.0610, "compile": 0.0156, "ltx": 0.0156}) == {}
    # a failed check (an exception) is no yardstick, and one result alone has none
    assert set(bench_ops.wrong_results({"eager": 1e-7, "liger": RuntimeError("layout"), "ltx": 1.0})) == {"ltx"}
    assert bench_ops.wrong_results({"ltx": 5.0, "eager": RuntimeError("out of memory")}) == {}


def test_fp8_shapes_option_parses_and_refuses():
    from benchmarks.ops import bench_fp8

    assert bench_fp8.parse_shapes("adaln_fp8:2x2688x2048, gelu_fp8:5376x8192") == [
        ("adaln_fp8", (2, 2688, 2048)), ("gelu_fp8", (5376, 8192))]
    for bad in ("adaln:2x2x8", "gelu_fp8", "gelu_fp8:4x", "gelu_fp8:0x8", "gelu_fp8:8192", "adaln_fp8:5376x2048"):
        with pytest.raises(ValueError, match=repr(bad)):  # the item named, as argparse prints it
            bench_fp8.parse_shapes(bad)


def test_host_time_is_the_issuing_time_of_one_call():
    """host_time_us divides the time of back-to-back calls by their count: a call that
    holds the host 2 ms reads about 2000 us, one that returns at once well below."""
    made = []
    slow = harness.host_time_us(lambda: (made.append(1), time.sleep(0.002)), calls=5, runs=3)
    assert len(made) == 1 + 5 * 3
    assert 2000 <= slow < 20000
    assert harness.host_time_us(lambda: None, calls=5, runs=3) < 200


@pytest.mark.parametrize("cap", [None, 192])
def test_capped_rotation_is_cold_or_l2_resident(monkeypatch, cap):
    """Input sets either span L2_MULTIPLE L2 sizes (cold for every call) or fit in half the
    L2 (resident for every implementation, whatever its outputs' footprint): never in
    between, where what stays in L2 would depend on the implementation."""
    l2 = 50 << 20
    monkeypatch.setattr(harness, "l2_bytes", lambda: l2)
    for size in (1, 2048, 100_000, 400_000, 800_000, 900_000, 10 << 20, 400 << 20):
        copies = harness.copies_for_cold_l2(size, cap)
        assert cap is None or copies <= cap
        cold = copies * size >= harness.L2_MULTIPLE * l2
        assert cold != harness.l2_resident(copies, size), (size, copies)
        assert cold or cap is not None


def test_runner_skips_a_wrong_implementation_untimed():
    timed = []

    def off_by_one(x):
        timed.append(x)
        return x * 2 + 1

    case = bench_ops.Case("double", "[4, 64]", lambda: (torch.randn(4, 64),),
                          {"eager": lambda x: x * 2, "ltx": off_by_one})
    runner = bench_ops.Runner(on_cuda=False, copy_gbs=1.0)
    runner.run([case])
    assert [row["impl"] for row in runner.rows] == ["eager"]
    [skipped] = runner.skipped
    assert skipped["impl"] == "ltx" and skipped["reason"].startswith("WrongResult: max abs err 1.0e+00")
    assert len(timed) == 1  # the check's call only


def test_wrong_ltx_fails_the_run_after_its_report(monkeypatch, tmp_path):
    import kernels

    ltx = kernels.get_local_kernel(REPO, backend="cpu")
    broken = types.SimpleNamespace(**{name: getattr(ltx, name) for name in dir(ltx) if not name.startswith("__")})
    broken.__name__ = "broken"
    broken.rms_norm = lambda x, weight, eps, **kw: ltx.rms_norm(x, weight, eps, **kw) + 1
    monkeypatch.setattr(kernels, "get_local_kernel", lambda *args, **kwargs: broken)
    report = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["bench_ops.py", "--smoke", "--ops", "rms_norm", "--json", str(report)])
    with pytest.raises(SystemExit, match="ltx computed wrong results: rms_norm"):
        bench_ops.main()
    skipped = json.loads(report.read_text())["skipped"]
    assert skipped and all(row["impl"] == "ltx" and row["reason"].startswith("WrongResult") for row in skipped)


def test_smoke_run_of_every_op_passes_the_check(monkeypatch, tmp_path):
    report = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["bench_ops.py", "--smoke", "--json", str(report)])
    bench_ops.main()  # no SystemExit: no ltx row is wrong
    results = json.loads(report.read_text())
    ops = {row["op"] for row in results["results"]}
    assert {"rms_norm", "adaln_rms", "rope_rotate_half", "geglu"} <= ops
    assert not [row for row in results["skipped"] if row["impl"] == "ltx"]


@pytest.mark.skipif(variants_build.find_nvcc() is None or torch.version.cuda is None,
                    reason="needs nvcc and a CUDA build of torch (CI and the GPU machine have both)")
@pytest.mark.parametrize("sm", ["75", "80", "90"])
@pytest.mark.parametrize("harness", ["rope_variants", "norm_variants"])
def test_variants_harness_compiles_without_spills(harness, sm, tmp_path):
    cubin, spills = variants_build.build(REPO / "benchmarks" / "tuning" / f"{harness}.cu", sm, tmp_path, check_only=True)
    assert cubin.stat().st_size > 0
    assert spills == []


def test_variants_library_is_rebuilt_after_its_sources_change(tmp_path, monkeypatch):
    """A harness library is taken as it is only while the digest its build wrote matches
    the sources (its .cu, kernel_src/); a changed header builds it again."""
    kernel_src = tmp_path / "kernel_src"
    kernel_src.mkdir()
    (kernel_src / "norm_forward.cuh").write_text("// v1\n")
    source = tmp_path / "norm_variants.cu"
    source.write_text("#include \"norm_forward.cuh\"\n")
    monkeypatch.setattr(variants_build, "REPO", tmp_path)
    library = tmp_path / "norm_variants_sm90.so"
    assert not variants_build.up_to_date(library, source, "90")
    library.write_bytes(b"")
    (tmp_path / "norm_variants_sm90.so.sha256").write_text(variants_build.sources_digest(source, "90"))
    assert variants_build.up_to_date(library, source, "90")
    assert not variants_build.up_to_date(library, source, "80")
    (kernel_src / "norm_forward.cuh").write_text("// v2\n")
    assert not variants_build.up_to_date(library, source, "90")
