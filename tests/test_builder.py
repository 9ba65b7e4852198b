"""The offline builder: build.toml validation, arch flags, variant names, spill detection."""

import shutil
import sys
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO))
from builder.__main__ import gencode_flags  # noqa: E402
from builder.compile import parse_ptxas  # noqa: E402
from builder.config import ConfigError, load_config  # noqa: E402
from builder.toolchain import Torch, variant_name  # noqa: E402


def test_repository_config():
    cfg = load_config(REPO)
    assert cfg.name == "ltx-kernels" and cfg.python_name == "ltx_kernels" and cfg.version == 1
    assert cfg.backends == ("cuda", "cpu")
    assert cfg.capabilities() == ("7.5", "8.0", "9.0")
    cuda_sources = {s for k in cfg.kernels_for("cuda") for s in k.compiled_sources}
    cpu_sources = {s for k in cfg.kernels_for("cpu") for s in k.compiled_sources}
    assert {"kernel_src/norm_forward.cu", "kernel_src/norm_backward.cu"} <= cuda_sources
    assert cpu_sources <= cuda_sources, "the CUDA variant also carries every CPU twin"


@pytest.fixture
def project(tmp_path):
    for item in ("build.toml", "kernel_src", "torch-ext"):
        src = REPO / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / item)
    return tmp_path


def edit(project: Path, old: str, new: str) -> None:
    path = project / "build.toml"
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    "old, new, message",
    [
        ('name = "ltx-kernels"\n', "", r"\[general\] lacks 'name'"),
        ('name = "ltx-kernels"', 'name = "ltx_kernels"', "lowercase and dash-separated"),
        ('license = "Apache-2.0"\n', "", r"\[general\] lacks 'license'"),
        ("version = 1", 'version = "1"', "version must be a int"),
        ('backends = ["cuda", "cpu"]', 'backends = ["cuda", "cpu", "tpu"]', "backends has 'tpu'"),
        ('backend = "cuda"', 'backend = "rocm"', "backend 'rocm' is not in"),
        ('"7.5", "8.0", "9.0"', '"7.5", "8.0", "9.5"', "cuda-capabilities has '9.5'"),
        ('cuda-capabilities = ["7.5", "8.0", "9.0"]\n', "", "needs cuda-capabilities"),
        ('"kernel_src/rope.cu"', '"kernel_src/missing.cu"', "names 'kernel_src/missing.cu', which does not exist"),
        ("[torch]", "[torch_sources]", r"\[root\] lacks 'torch'"),
        ("[general]", "[general", "does not parse"),
    ],
    ids=["no_name", "underscore_name", "no_license", "version_type", "unknown_backend",
         "section_backend", "bad_capability", "no_capabilities", "missing_source", "no_torch",
         "syntax"],
)
def test_bad_build_toml_is_refused_with_a_clear_message(project, old, new, message):
    edit(project, old, new)
    with pytest.raises(ConfigError, match=message):
        load_config(project)


def test_cpu_section_with_cuda_source_is_refused(project):
    text = (project / "build.toml").read_text()
    head, cpu_section = text.split("[kernel.norm_cpu]")
    cpu_section = cpu_section.replace('"kernel_src/norm_cpu.cpp"', '"kernel_src/norm_forward.cu"')
    (project / "build.toml").write_text(head + "[kernel.norm_cpu]" + cpu_section)
    with pytest.raises(ConfigError, match="is a cpu kernel but lists .cu sources"):
        load_config(project)


def test_gencode_ships_sass_for_each_arch_and_ptx_for_the_newest():
    assert gencode_flags(("7.5", "8.0", "9.0")) == [
        "-gencode", "arch=compute_75,code=sm_75",
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90,code=[sm_90,compute_90]",
    ]


def test_variant_names_match_what_kernels_loads():
    torch = Torch(version=(2, 11), cuda="13.0", cxx11_abi=True, include_dirs=(), lib_dir=Path())
    assert variant_name(torch, "cuda") == "torch211-cxx11-cu130-x86_64-linux"
    assert variant_name(torch, "cpu") == "torch211-cxx11-cpu-x86_64-linux"


def test_ptxas_report_finds_spills():
    log = """\
ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90'
ptxas info    : Function properties for _Z6kernelPf
    120 bytes stack frame, 68 bytes spill stores, 436 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 388 bytes cmem[0]
ptxas info    : Compiling entry function '_Z5cleanPf' for 'sm_80'
ptxas info    : Function properties for _Z5cleanPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 30 registers, used 0 barriers, 360 bytes cmem[0]
"""
    spilling, clean = parse_ptxas(log)
    assert (spilling.arch, spilling.registers, spilling.spill_stores, spilling.spill_loads) == ("sm_90", 64, 68, 436)
    assert spilling.spills and spilling.kernel == "kernel(float*)"
    assert (clean.arch, clean.registers, clean.spills) == ("sm_80", 30, False)


@pytest.mark.rebuilds_build_folder
def test_a_damaged_build_is_rebuilt():
    """Every build reassembles build/<variant>/ from checked objects: a deleted extension,
    an edited _ops.py, a stray file or a truncated cached object do not survive it."""
    import subprocess

    from test_build_layout import expected_variant

    folder = REPO / "build" / expected_variant("cpu")
    (so,) = folder.glob("*.so")
    so.unlink()
    (folder / "_ops.py").write_text("broken = True\n")
    (folder / "stray.txt").write_text("left over\n")
    cached = sorted((REPO / ".build-cache" / expected_variant("cpu") / "obj").glob("*.o"))[0]
    cached.write_bytes(cached.read_bytes()[:100])
    proc = subprocess.run([sys.executable, "-m", "builder", "--backend", "cpu"], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"{cached.name.replace('__', '/')[:-2]}  up to date" not in proc.stdout, "the damaged object was recompiled"
    # One extension again, under the name of the tree's current state (a commit or an edit
    # since the last build renames it).
    assert len(list(folder.glob("*.so"))) == 1 and not (folder / "stray.txt").exists()
    assert "ops = torch.ops._ltx_kernels_cpu_" in (folder / "_ops.py").read_text()
