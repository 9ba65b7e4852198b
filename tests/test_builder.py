"""The offline builder: build.toml validation (edition 6, as kernel-builder reads it), arch
flags, variant names, spill detection."""

import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

from builder.__main__ import gencode_flags
from builder.compile import parse_ptxas
from builder.config import KNOWN_CAPABILITIES, ConfigError, check_with_kernels, load_config
from builder.toolchain import Torch, find_torch, variant_name

CAPABILITIES = ("7.5", "8.0", "9.0+PTX")


def test_repository_config():
    cfg = load_config(REPO)
    assert cfg.name == "ltx-kernels" and cfg.python_name == "ltx_kernels" and cfg.version == 1
    assert cfg.backends == ("cuda", "cpu")
    assert cfg.capabilities() == CAPABILITIES
    cuda_sources = {s for k in cfg.kernels_for("cuda") for s in k.compiled_sources}
    cpu_sources = {s for k in cfg.kernels_for("cpu") for s in k.compiled_sources}
    assert {"kernel_src/norm_forward.cu", "kernel_src/norm_backward.cu"} <= cuda_sources
    assert cpu_sources <= cuda_sources, "the CUDA variant also carries every CPU twin"


def test_kernel_builders_parser_reads_build_toml_without_a_warning(capfd):
    """kernels' own copy of kernel-builder's parser: it prints its warnings (e.g. "uses the
    legacy v4 format; upgrading to edition 6 in memory") to file descriptor 2 from Rust,
    past sys.stderr, so capfd, not capsys."""
    rust = kernels_parser()
    build = rust.Build.open(REPO)
    assert build.general.backends == [rust.Backend.CUDA, rust.Backend.CPU]
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


def kernels_parser():
    """kernels._rust, when its build.toml parser reads edition 6 (kernels 0.18 and later)."""
    rust = pytest.importorskip("kernels._rust")
    if not check_with_kernels(REPO):
        pytest.skip("this kernels' build.toml parser predates edition 6")
    return rust


@pytest.fixture
def project(tmp_path):
    for item in ("build.toml", "kernel_src", "torch-ext"):
        src = REPO / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / item)
    return tmp_path


def edit(project: Path, old: str, new: str, count: int = 1) -> None:
    path = project / "build.toml"
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, count))


CAPS_LINE = 'cuda-capabilities = ["7.5", "8.0", "9.0+PTX"]'


@pytest.mark.parametrize(
    "old, new, count, message",
    [
        ('name = "ltx-kernels"\n', "", 1, r"\[general\] lacks 'name'"),
        ('name = "ltx-kernels"', 'name = "ltx_kernels"', 1, "lowercase and dash-separated"),
        ('license = "Apache-2.0"\n', "", 1, r"\[general\] lacks 'license'"),
        ("version = 1", 'version = "1"', 1, "version must be a int"),
        ('backends = ["cuda", "cpu"]', 'backends = ["cuda", "cpu", "tpu"]', 1, "backends has 'tpu'"),
        ('language = "cpp-cuda"', 'language = "cpp-rocm"', 1, "language 'cpp-rocm': this builder knows"),
        ('language = "cpp-cuda"', 'language = "cuda"', 1, "language 'cuda': this builder knows"),
        ('"8.0", "9.0+PTX"', '"8.0", "9.5+PTX"', 3, r"cuda-capabilities has '9.5\+PTX'"),
        ('"9.0+PTX"', '"9.0+ptx"', 3, r"cuda-capabilities has '9.0\+ptx'"),
        ('"7.5", "8.0"', '"7.5", "7.5"', 3, "lists a capability twice"),
        ('"7.5", "8.0"', '"8.0"', 1, "list different cuda-capabilities"),
        (CAPS_LINE + "\n", "", 1, "needs cuda-capabilities"),
        ('"kernel_src/rope.cu"', '"kernel_src/missing.cu"', 1, "names 'kernel_src/missing.cu', which does not exist"),
        ('depends = ["torch"]', 'depends = ["torch", "cutlass_3_8"]', 1, "depends on 'cutlass_3_8'"),
        ('depends = ["torch"]\n', "", 1, r"\[kernel.norm\] lacks 'depends'"),
        ("[torch]", "[torch_sources]", 1, "unknown table or field 'torch_sources'"),
        ("[general]", "[general", 1, "does not parse"),
        # Unknown fields: kernel-builder refuses them, so the builder does too.
        ('license = "Apache-2.0"', 'license = "Apache-2.0"\nlicence = "MIT"', 1,
         r"\[general\] has unknown field 'licence'"),
        ('repo-id = "', 'repo_id = "', 1, r"\[general.hub\] has unknown field 'repo_id'"),
        ("[torch]\n", '[torch]\nsources = ["x"]\n', 1, r"\[torch\] has unknown field 'sources'"),
        (CAPS_LINE, CAPS_LINE + '\ncuda-archs = ["9.0"]', 1, r"\[kernel.norm\] has unknown field 'cuda-archs'"),
        # A CPU section takes no CUDA fields (kernel-builder: unknown field).
        ('language = "cpp-cpu"', 'language = "cpp-cpu"\ncuda-capabilities = ["9.0"]', 1,
         r"\[kernel.norm_cpu\] has unknown field 'cuda-capabilities'"),
        # Known to kernel-builder, not implemented here: refused, not ignored.
        (CAPS_LINE, CAPS_LINE + '\ncuda-flags = ["-lineinfo"]', 1, "cuda-flags is valid in edition 6, but the offline"),
        ("[torch]\n", '[torch]\nstable-abi = "2.10"\n', 1, "stable-abi is valid in edition 6, but the offline"),
        ('license = "Apache-2.0"', 'license = "Apache-2.0"\nupstream = "https://example.org/x"', 1,
         "upstream is valid in edition 6, but the offline"),
        ("edition = 6", "edition = 7", 1, "edition = 7; this builder reads edition 6"),
    ],
    ids=["no_name", "underscore_name", "no_license", "version_type", "unknown_backend", "other_language",
         "backend_as_language", "bad_capability", "lowercase_ptx", "capability_twice", "capabilities_differ",
         "no_capabilities", "missing_source", "other_dependency", "no_depends", "no_torch", "syntax",
         "unknown_general_field", "unknown_hub_field", "unknown_torch_field", "unknown_kernel_field",
         "cuda_field_in_cpu_section", "unimplemented_cuda_flags", "unimplemented_stable_abi",
         "unimplemented_upstream", "newer_edition"],
)
def test_bad_build_toml_is_refused_with_a_clear_message(project, old, new, count, message):
    edit(project, old, new, count)
    with pytest.raises(ConfigError, match=message):
        load_config(project)


def legacy(text: str) -> str:
    """The same file in the legacy v4 spelling."""
    text = text.replace("edition = 6\n", "")
    return text.replace('language = "cpp-cuda"', 'backend = "cuda"').replace('language = "cpp-cpu"', 'backend = "cpu"')


LEGACY_FIX = (r'build.toml is the legacy v4 format: set edition = 6 in \[general\] and write language = "cpp-cuda" '
              r'\(or "cpp-cpu"\) instead of backend = "cuda" \(or "cpu"\) in each \[kernel.\*\] section '
              r"\(kernel-builder update-build does this\)")


def test_legacy_format_is_refused_with_the_fix(project):
    path = project / "build.toml"
    path.write_text(legacy(path.read_text()))
    with pytest.raises(ConfigError, match=LEGACY_FIX):
        load_config(project)


def test_legacy_backend_field_is_refused_in_an_edition_6_file(project):
    edit(project, 'language = "cpp-cpu"', 'backend = "cpu"')
    with pytest.raises(ConfigError, match=r'\[kernel.norm_cpu\] uses backend =, the legacy spelling: write '
                                          r'language = "cpp-cuda" \(or "cpp-cpu"\) instead'):
        load_config(project)


def test_edition_5_with_backend_fields_is_refused_with_the_fix(project):
    path = project / "build.toml"
    path.write_text(legacy(path.read_text()).replace('version = 1\n', 'version = 1\nedition = 5\n'))
    with pytest.raises(ConfigError, match="build.toml is edition 5: set edition = 6"):
        load_config(project)


def test_kernels_parser_agrees_on_what_this_builder_refuses(project, capfd):
    """Each refusal above that kernel-builder shares: its parser refuses (or, for a
    legacy file, warns about) the same edits."""
    rust = kernels_parser()
    path = project / "build.toml"
    original = path.read_text()
    for old, new in [('license = "Apache-2.0"', 'license = "Apache-2.0"\nlicence = "MIT"'),
                     (CAPS_LINE, CAPS_LINE + '\ncuda-archs = ["9.0"]'),
                     ('language = "cpp-cpu"', 'language = "cpp-cpu"\ncuda-capabilities = ["9.0"]'),
                     ('language = "cpp-cpu"', 'backend = "cpu"'),
                     ('language = "cpp-cuda"', 'language = "cuda"')]:
        path.write_text(original.replace(old, new, 1))
        with pytest.raises(ValueError):
            rust.Build.open(project)
    path.write_text(legacy(original))
    capfd.readouterr()
    rust.Build.open(project)
    assert "legacy v4 format" in capfd.readouterr().err


def test_builder_reports_what_kernels_parser_warns_about(project, monkeypatch):
    """check_with_kernels fails on a warning of kernel-builder's parser, not only an error."""
    rust = kernels_parser()
    real_build = rust.Build

    class Warns:
        @staticmethod
        def open(root):
            import os
            os.write(2, b"\xe2\x9a\xa0\xef\xb8\x8f  something kernel-builder dislikes\n")
            return real_build.open(root)

    monkeypatch.setattr(rust, "Build", Warns)
    with pytest.raises(ConfigError, match="warns about build.toml: .*something kernel-builder dislikes"):
        check_with_kernels(project)


def test_builder_reads_build_toml_without_kernels_installed(project, monkeypatch):
    monkeypatch.setitem(sys.modules, "kernels._rust", None)  # import kernels._rust now fails
    assert check_with_kernels(project) is False
    assert load_config(project).capabilities() == CAPABILITIES


def test_cpu_section_with_cuda_source_is_refused(project):
    text = (project / "build.toml").read_text()
    head, cpu_section = text.split("[kernel.norm_cpu]")
    cpu_section = cpu_section.replace('"kernel_src/norm_cpu.cpp"', '"kernel_src/norm_forward.cu"')
    (project / "build.toml").write_text(head + "[kernel.norm_cpu]" + cpu_section)
    with pytest.raises(ConfigError, match="is a cpu kernel but lists .cu sources"):
        load_config(project)


def test_blackwell_capabilities_are_read_as_written(project):
    """SASS for 10.0 and 12.0 too, PTX of 12.0 only; metadata.json records them so."""
    import json

    from builder import generate

    sections = (project / "build.toml").read_text().count(CAPS_LINE)  # every CUDA section
    edit(project, CAPS_LINE, 'cuda-capabilities = ["12.0+PTX", "7.5", "8.0", "9.0", "10.0"]', count=sections)
    cfg = load_config(project)
    assert cfg.capabilities() == ("7.5", "8.0", "9.0", "10.0", "12.0+PTX")
    meta = json.loads(generate.metadata_json(cfg, "cuda", "_x", {"algorithm": "sha256", "files": {}}))
    assert meta["backend"]["archs"] == ["7.5", "8.0", "9.0", "10.0", "12.0+PTX"]


def test_torch_bounds_are_honoured(project):
    edit(project, "[torch]\n", '[torch]\nminver = "2.14"\nmaxver = "2.15"\n')
    cfg = load_config(project)
    assert cfg.torch_supported((2, 14)) is None and cfg.torch_supported((2, 15)) is None
    assert "older than build.toml's [torch] minver 2.14" in cfg.torch_supported((2, 13))
    assert "newer than build.toml's [torch] maxver 2.15" in cfg.torch_supported((2, 16))


def test_gencode_ships_sass_for_each_arch_and_ptx_only_where_written():
    assert gencode_flags(CAPABILITIES) == [
        "-gencode", "arch=compute_75,code=sm_75",
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90,code=[sm_90,compute_90]",
    ]
    assert gencode_flags(("7.5", "8.0", "9.0", "10.0", "12.0+PTX")) == [
        "-gencode", "arch=compute_75,code=sm_75",
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90,code=sm_90",
        "-gencode", "arch=compute_100,code=sm_100",
        "-gencode", "arch=compute_120,code=[sm_120,compute_120]",
    ]
    assert gencode_flags(("8.0+PTX", "9.0")) == [
        "-gencode", "arch=compute_80,code=[sm_80,compute_80]",
        "-gencode", "arch=compute_90,code=sm_90",
    ]


def test_known_capabilities_are_what_nvcc_compiles():
    """KNOWN_CAPABILITIES is nvcc 13.0's `--list-gpu-code`; a newer nvcc may know more."""
    from builder.toolchain import find_nvcc

    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc")
    import subprocess

    listed = subprocess.run([str(nvcc.path), "--list-gpu-code"], capture_output=True, text=True).stdout.split()
    codes = {f"sm_{c.replace('.', '')}" for c in KNOWN_CAPABILITIES}
    assert codes <= set(listed)
    for cap in (*CAPABILITIES, "10.0", "12.0"):
        assert f"sm_{cap.split('+')[0].replace('.', '')}" in listed


def test_variant_names_match_what_kernels_loads():
    torch = Torch(version=(2, 11), cuda="13.0", cxx11_abi=True, include_dirs=(), lib_dir=Path())
    assert variant_name(torch, "cuda") == "torch211-cxx11-cu130-x86_64-linux"
    assert variant_name(torch, "cpu") == "torch211-cxx11-cpu-x86_64-linux"
    # A CUDA variant is named after the toolkit that built it, which may be older than torch's.
    torch215 = Torch(version=(2, 15), cuda="13.2", cxx11_abi=True, include_dirs=(), lib_dir=Path())
    assert variant_name(torch215, "cuda", "13.0") == "torch215-cxx11-cu130-x86_64-linux"


def test_cuda_variant_needs_an_nvcc_no_newer_than_torchs_cuda(capsys):
    """The CUDA variant is named after nvcc's CUDA; kernels loads a cu<X.Y> variant only
    under a torch built for CUDA X.Y or a later X minor, so nvcc 13.0 serves torch's 13.2."""
    from builder.__main__ import choose_backends
    from builder.toolchain import Nvcc, ToolchainError

    cfg = load_config(REPO)
    torch132 = Torch(version=(2, 15), cuda="13.2", cxx11_abi=True, include_dirs=(), lib_dir=Path())
    torch130 = Torch(version=(2, 14), cuda="13.0", cxx11_abi=True, include_dirs=(), lib_dir=Path())
    nvcc130 = Nvcc(Path("nvcc"), (13, 0), Path("/usr/local/cuda"))
    nvcc132 = Nvcc(Path("nvcc"), (13, 2), Path("/usr/local/cuda"))
    assert choose_backends(cfg, torch132, nvcc130, "all") == ["cuda", "cpu"]
    assert choose_backends(cfg, torch130, nvcc132, "auto") == ["cpu"]
    assert "nvcc 13.2 is newer than torch's CUDA 13.0" in capsys.readouterr().out
    with pytest.raises(ToolchainError, match="kernels would not load a cu132 variant under this torch"):
        choose_backends(cfg, torch130, nvcc132, "all")


def test_release_env_is_reused_once_ready(tmp_path, monkeypatch):
    """An environment whose marker names what it holds is used as it is: no pip run."""
    from builder import release

    env = tmp_path / ".release-envs" / "torch-2.15.0"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    (env / release.READY).write_text("\n".join(release.requirements("2.15.0")) + "\n")
    monkeypatch.setattr(release.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    assert release.ensure_env(tmp_path, "2.15.0").path == env


def test_release_env_installs_with_its_own_constraints(tmp_path, monkeypatch):
    """pip in a release environment gets that environment's constraints file (the
    machine's pip.conf may cap torch); the machine's configuration is left alone."""
    from builder import release

    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, kwargs.get("env")))
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[3]) / "bin").mkdir(parents=True)
            (Path(cmd[3]) / "bin" / "python").write_text("")
        return __import__("subprocess").CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(release.subprocess, "run", run)
    env = release.ensure_env(tmp_path, "2.15.0")
    (venv_cmd, _), (pip_cmd, pip_env) = calls
    assert venv_cmd[1:] == ["-m", "venv", str(env.path)]
    assert pip_cmd[-2:] == ["torch==2.15.0", f"kernels=={release.RELEASE_KERNELS}"]
    assert pip_env["PIP_CONSTRAINT"] == str(env.path / "constraints.txt")
    assert (env.path / "constraints.txt").read_text() == "torch==2.15.0\n"
    assert (env.path / release.READY).is_file()


def test_torch_is_read_without_importing_it():
    """find_torch reads version.py and libc10.so; the values are what torch says itself."""
    torch = pytest.importorskip("torch")
    found = find_torch()
    assert found.release == torch.__version__
    assert found.version == tuple(int(v) for v in torch.__version__.split(".")[:2])
    assert found.cuda == torch.version.cuda
    assert found.cxx11_abi == torch.compiled_with_cxx11_abi()
    assert found.lib_dir == Path(torch.__file__).parent / "lib"


PTXAS_LOG = """\
ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90'
ptxas info    : Function properties for _Z6kernelPf
    120 bytes stack frame, 68 bytes spill stores, 436 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 388 bytes cmem[0]
ptxas info    : Compiling entry function '_Z5cleanPf' for 'sm_80'
ptxas info    : Function properties for _Z5cleanPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 30 registers, used 0 barriers, 360 bytes cmem[0]
"""

# nvcc 13.0's report for the newer archs (no cmem line).
PTXAS_LOG_BLACKWELL = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z1kPf' for 'sm_100'
ptxas info    : Function properties for _Z1kPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers
ptxas info    : Compile time = 1.755 ms
ptxas info    : Compiling entry function '_Z1kPf' for 'sm_120'
ptxas info    : Function properties for _Z1kPf
    16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers
"""


def test_ptxas_report_finds_spills():
    spilling, clean = parse_ptxas(PTXAS_LOG)
    assert (spilling.arch, spilling.registers, spilling.spill_stores, spilling.spill_loads) == ("sm_90", 64, 68, 436)
    assert spilling.spills and spilling.kernel == "kernel(float*)"
    assert (clean.arch, clean.registers, clean.spills) == ("sm_80", 30, False)
    sm100, sm120 = parse_ptxas(PTXAS_LOG_BLACKWELL)
    assert (sm100.arch, sm100.registers, sm100.spills) == ("sm_100", 8, False)
    assert (sm120.arch, sm120.registers, sm120.spills) == ("sm_120", 255, True)


def test_a_spill_on_any_one_arch_fails_the_build(tmp_path):
    """The check reads every arch's report: one kernel spilling on sm_120 alone is enough."""
    from builder.compile import CompileError, Job, run_jobs

    obj = tmp_path / "k.o"
    emit = f"printf '%s' {shlex.quote(PTXAS_LOG_BLACKWELL)} >&2; touch {shlex.quote(str(obj))}"
    with pytest.raises(CompileError, match=r"sm_120 k\(float\*\): 8 B stores, 8 B loads"):
        run_jobs([Job("k.cu", tmp_path / "k.cu", obj, ["sh", "-c", emit])], workers=1, prefix="test")


def test_a_source_edited_while_it_compiles_is_compiled_again(tmp_path):
    """The stamp hashes the inputs after the compile: one edited meanwhile (the object may
    hold its old text) leaves no stamp, so the next build compiles it again; an untouched
    one is up to date."""
    from builder.compile import Job, run_jobs

    src, obj = tmp_path / "k.cu", tmp_path / "k.o"
    src.write_text("old\n")
    depfile = f"printf 'k.o: %s\\n' {shlex.quote(str(src))} > {shlex.quote(str(obj.with_suffix('.d')))}"
    touch = f"touch {shlex.quote(str(obj))}"
    # One command for every build (it is in the stamp): while the flag exists it edits the
    # source, past the file clock's tick of the compile's start.
    flag = tmp_path / "edit"
    edit = f"if [ -e {shlex.quote(str(flag))} ]; then sleep 0.05; echo new >> {shlex.quote(str(src))}; fi"
    job = Job("k.cu", src, obj, ["sh", "-c", f"{edit}; {depfile}; {touch}"])

    def build(edit):
        flag.write_text("") if edit else flag.unlink(missing_ok=True)
        (result,) = run_jobs([job], workers=1, prefix="test")
        return result.cached

    assert build(edit=True) is False
    assert build(edit=False) is False, "the source edited during its compile was taken as up to date"
    assert build(edit=False) is True
    # a source whose time is ahead of the clock (copied off another machine) is stamped
    src.write_text("copied\n")
    ahead = time.time_ns() + 3600 * 10**9
    os.utime(src, ns=(ahead, ahead))
    assert build(edit=False) is False
    assert build(edit=False) is True, "a source dated in the future compiled again at every build"


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
