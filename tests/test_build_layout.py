"""The built variant folders are what `kernels` resolves and loads, without a warning."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, TARGETS, load_variant

from builder import digest, generate
from builder.config import load_config
from builder.toolchain import Torch, find_nvcc, needed_libraries, variant_name

BACKENDS = sorted({b for b, _ in TARGETS})
CAPABILITIES = ["7.5", "8.0", "9.0+PTX"]


def expected_variant(backend: str) -> str:
    """The legacy name (every kernels release reads it); a CUDA variant carries the CUDA of
    the toolkit that built it (nvcc's, no newer than torch's)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    if backend == "cpu":
        compute = "cpu"
    else:
        nvcc = find_nvcc()
        cuda = f"{nvcc.version[0]}.{nvcc.version[1]}" if nvcc else torch.version.cuda
        compute = "cu" + "".join(cuda.split(".")[:2])
    return f"torch{major}{minor}-cxx11-{compute}-x86_64-linux"


def kernels_module(name: str):
    """A module of kernels: kernels._internals.<name> since 0.19, kernels.<name> before."""
    import importlib

    try:
        return importlib.import_module(f"kernels._internals.{name}")
    except ImportError:
        return importlib.import_module(f"kernels.{name}")


def variants_module():
    return kernels_module("variants")


@pytest.mark.parametrize("backend", BACKENDS)
def test_variant_folder_is_the_one_kernels_resolves(backend):
    variants = variants_module()
    folder = REPO / "build" / expected_variant(backend)
    assert folder.is_dir(), f"{folder} missing: run `python -m builder` first"
    chosen, trace = variants.resolve_variant(variants.get_variants_local(REPO / "build"), backend)
    assert chosen is not None, trace
    assert chosen.variant_str == folder.name


def test_legacy_names_are_the_new_names_to_kernels():
    """kernels 0.19 reads both spellings as the same variant; 0.17 and 0.18 take the new
    one for a noarch variant of an unknown backend (never loaded), which is why the
    builder writes the legacy one."""
    import kernels
    from packaging.version import Version

    variants = variants_module()
    reads_new_names = Version(kernels.__version__) >= Version("0.19")
    for legacy, new in [("torch215-cxx11-cu130-x86_64-linux",
                         "torch-2.15-cxx11-cuda-13.0-cpython-3.9-abi3-x86_64-linux"),
                        ("torch215-cxx11-cpu-x86_64-linux", "torch-2.15-cxx11-cpu-cpython-3.9-abi3-x86_64-linux")]:
        assert variants.parse_variant(legacy).variant_str == legacy
        if reads_new_names:
            assert variants.parse_variant(legacy) == variants.parse_variant(new)
        else:
            assert not isinstance(variants.parse_variant(new), variants.ArchVariant)


TORCH_215 = Torch(version=(2, 15), cuda="13.2", cxx11_abi=True, include_dirs=(), lib_dir=Path(),
                  release="2.15.0+cu132")


@pytest.mark.parametrize("system_cuda", ["13.0", "13.2"])
def test_release_variants_for_torch_215_are_what_kernels_resolves_there(system_cuda):
    """Without building for torch 2.15 (CI builds only the installed torch): the names the
    release build gives torch 2.15.0's variants (built with nvcc 13.0; PyPI's torch 2.15.0
    is a CUDA 13.2 build, the PyTorch index also has 13.0) are what kernels 0.19's resolver
    picks for an environment with torch 2.15, and not for one with torch 2.14."""
    import inspect

    from packaging.version import Version

    variants = variants_module()
    backends = kernels_module("backends")
    CPU, CUDA = backends.CPU, backends.CUDA

    names = {b: variant_name(TORCH_215, b, "13.0") for b in ("cuda", "cpu")}
    assert names == {"cuda": "torch215-cxx11-cu130-x86_64-linux", "cpu": "torch215-cxx11-cpu-x86_64-linux"}
    built = [variants.parse_variant(n) for n in [*names.values(), expected_variant("cpu")]]
    system = dict(cpu="x86_64", os="linux", torch_cxx11_abi=True, tvm_ffi_version=None)
    if "python_version" in inspect.signature(variants._resolve_variant_for_system).parameters:
        system["python_version"] = Version("3.11")
    for backend, selected in (("cuda", CUDA(version=Version(system_cuda))), ("cpu", CPU())):
        chosen, trace = variants._resolve_variant_for_system(
            built, selected_backend=selected, torch_version=Version("2.15"), **system)
        assert chosen and chosen[0].variant_str == names[backend], trace
        chosen, _ = variants._resolve_variant_for_system(
            [variants.parse_variant(names[backend])], selected_backend=selected, torch_version=Version("2.14"),
            **system)
        assert chosen == []


def test_release_metadata_is_what_kernels_reads(tmp_path):
    """The metadata.json the builder writes for any torch (it does not depend on torch's
    version): kernels parses it, its archs cover the GPUs they should, and its digest
    verifies the folder it was made for."""
    from kernels._rust import Metadata

    cfg = load_config(REPO)
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "_ltx_kernels_cuda_0000000.abi3.so").write_bytes(b"\0ELF")
    text = generate.metadata_json(cfg, "cuda", "_ltx_kernels_cuda_0000000", digest.hash_variant(tmp_path))
    (tmp_path / "metadata.json").write_text(text)
    meta = Metadata.from_bytes(text.encode())
    assert meta.backend.archs == CAPABILITIES and meta.digest is not None
    assert sorted(meta.digest.files) == ["__init__.py", "_ltx_kernels_cuda_0000000.abi3.so"]
    assert_digest_verifies(tmp_path, meta)

    _supports_cuda_capability = kernels_module("archs")._supports_cuda_capability

    # SASS runs on its major's later minors (8.0 on 8.6 and 8.9); 9.0's PTX lets every
    # later GPU (Blackwell: 10.x, 11.0, 12.x) JIT it.
    for cc in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]:
        assert _supports_cuda_capability(meta.backend.archs, cc), cc
    for cc in [(7, 0), (6, 1)]:
        assert not _supports_cuda_capability(meta.backend.archs, cc), cc


def assert_digest_verifies(folder: Path, meta) -> None:
    """kernels' own check of a local variant (verify_digest, 0.18+), else what it does."""
    from kernels._rust import Digest

    try:
        verify = kernels_module("digest")
    except ImportError:
        meta.digest.validate(Digest.hash_variant(meta.digest.algorithm, folder))  # raises on a mismatch
        return
    result = verify.verify_digest(folder, metadata=meta, location=None)
    assert isinstance(result, verify.DigestVerificationResult.Success), str(result)


@pytest.mark.parametrize("backend", BACKENDS)
def test_variant_contents_and_metadata(backend):
    from kernels._rust import Metadata

    folder = REPO / "build" / expected_variant(backend)
    raw = json.loads((folder / "metadata.json").read_text())
    meta = Metadata.read_from_file(folder / "metadata.json")
    assert str(meta.name) == "ltx-kernels" and meta.version == 1 and meta.license == "Apache-2.0"
    assert raw["python-depends"] == [] and raw["backend"]["type"] == backend
    if backend == "cuda":
        assert raw["backend"]["archs"] == CAPABILITIES
    else:
        assert "archs" not in raw["backend"]
    assert re.fullmatch(rf"_ltx_kernels_{backend}_[0-9a-f]{{7}}(_dirty)?", meta.id)

    so_files = sorted(p.name for p in folder.glob("*.so"))
    assert so_files == [f"{meta.id}.abi3.so"], "exactly one extension, named after the id"
    ops_py = (folder / "_ops.py").read_text()
    assert f"ops = torch.ops.{meta.id}" in ops_py
    package = {p.name for p in (REPO / "torch-ext" / "ltx_kernels").glob("*.py")}
    assert package <= {p.name for p in folder.glob("*.py")}


@pytest.mark.parametrize("backend", BACKENDS)
def test_digest_is_recorded_and_verifies(backend):
    """kernels 0.18+ warns on every load of a variant whose metadata.json has no digest, and
    refuses one whose files differ from it. metadata.json itself is not hashed."""
    from kernels._rust import Digest, DigestAlgorithm, Metadata

    folder = REPO / "build" / expected_variant(backend)
    meta = Metadata.read_from_file(folder / "metadata.json")
    assert meta.digest is not None and meta.digest.algorithm == DigestAlgorithm.SHA256
    assert "metadata.json" not in meta.digest.files
    assert f"{meta.id}.abi3.so" in meta.digest.files and "_ops.py" in meta.digest.files
    assert_digest_verifies(folder, meta)
    # The builder's own digest (it needs no kernels) is kernels' own, file for file.
    assert dict(Digest.hash_variant(DigestAlgorithm.SHA256, folder).files) == digest.hash_variant(folder)["files"]
    assert dict(Digest.hash_variant(DigestAlgorithm.SHA512, folder).files) == \
        digest.hash_variant(folder, "sha512")["files"]


def test_python_digest_follows_kernels_rules(tmp_path):
    """What kernels' digest leaves out and how it names files, on a made-up folder."""
    from kernels._rust import Digest, DigestAlgorithm

    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "sub").mkdir()
    for rel, data in [("_ext.so", b"hello world"), ("metadata.json", b"{}"), ("metadata.json.sigstore", b"s"),
                      ("pkg/__pycache__/m.cpython-311.pyc", b"b"), ("payload.pyc", b"p"), ("pkg/mod.py", b"x"),
                      ("sub/metadata.json", b"{\"nested\": true}")]:
        (tmp_path / rel).write_bytes(data)
    (tmp_path / "link.py").symlink_to(tmp_path / "pkg" / "mod.py")
    (tmp_path / "linkdir").symlink_to(tmp_path / "sub")
    ours = digest.hash_variant(tmp_path)["files"]
    assert ours == dict(Digest.hash_variant(DigestAlgorithm.SHA256, tmp_path).files)
    assert sorted(ours) == ["_ext.so", "link.py", "pkg/mod.py", "sub/metadata.json"]
    assert ours["_ext.so"] == "uU0nuZNNPgilLlLX2n2r+sSE7+N6U4DukIj3rOLvzek="


@pytest.mark.parametrize("backend", BACKENDS)
def test_loading_reports_nothing(backend):
    """get_local_kernel loads the variant with no logged warning, no Python warning and
    nothing on stderr (in a fresh process: the check the release build runs)."""
    proc = subprocess.run([sys.executable, str(REPO / "builder" / "load_check.py"), str(REPO), backend,
                           expected_variant(backend)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["reported"] == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_extension_passes_the_abi_check(backend):
    from kernel_abi_check import ObjectFile

    (so,) = (REPO / "build" / expected_variant(backend)).glob("*.so")
    obj = ObjectFile(so)
    assert list(obj.check_manylinux("manylinux_2_28")) == []
    assert list(obj.check_python_abi("3.9")) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_extension_shares_the_process_libstdcxx(backend):
    """A private (static) libstdc++ beside torch's crashes on the first error message."""
    (so,) = (REPO / "build" / expected_variant(backend)).glob("*.so")
    needed = needed_libraries(so)
    assert needed is not None, "readelf missing"
    assert "libstdc++.so.6" in needed and "libc10.so" in needed


@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_live_in_the_build_namespace(backend):
    kernel = load_variant(backend)
    namespace = kernel.ops.name
    assert namespace.startswith(f"_ltx_kernels_{backend}_")
    for op in ("rms_norm", "rms_norm_out"):
        assert hasattr(getattr(torch.ops, namespace), op)
    assert set(kernel.__all__) >= {"rms_norm", "layers"}


def test_generated_files_are_not_in_the_source_tree():
    assert not (REPO / "torch-ext" / "registration.h").exists()
    assert not (REPO / "torch-ext" / "ltx_kernels" / "_ops.py").exists()


FP8_KERNEL = re.compile(r"Fp8E4m3|quantize_fp8_kernel|rms_norm_row_fp8_kernel")


def test_fp8_kernels_have_bodies_where_sm89_runs_them():
    """Ada (sm_89) runs the sm_80 build (no compute_90 PTX serves it) and Hopper the sm_90
    one: there every FP8 kernel has a body; only the sm_75 build's are a trap (a few
    registers), the ops refusing GPUs below sm_89. Read from the CUDA build's ptxas report."""
    if "cuda" not in BACKENDS:
        pytest.skip("no CUDA variant built here")
    report = REPO / ".build-cache" / expected_variant("cuda") / "registers.txt"
    rows = [line.split() for line in report.read_text().splitlines() if FP8_KERNEL.search(line)]
    regs = {}
    for row in rows:  # "sm_80 regs 64 stack 0B spill 0/0B <kernel>"
        regs.setdefault(row[0], []).append(int(row[2]))
    assert set(regs) == {"sm_75", "sm_80", "sm_90"} and len(regs["sm_80"]) >= 60, {a: len(r) for a, r in regs.items()}
    assert min(regs["sm_80"]) > 8 and min(regs["sm_90"]) > 8, "an FP8 kernel compiled to a trap where Ada or Hopper runs it"
    assert max(regs["sm_75"]) <= 8


def test_the_hub_card_names_every_public_function_and_layer():
    """CARD.md (the Hub page) lists what the package exports and every kernelize layer."""
    import inspect

    kernel = load_variant(BACKENDS[0])
    card = (REPO / "CARD.md").read_text()
    functions = [n for n in kernel.__all__ if n not in ("layers", "ops", "reference")]
    layers = [n for n, c in vars(kernel.layers).items() if inspect.isclass(c) and hasattr(c, "has_backward")]
    assert len(layers) >= 10
    assert [n for n in functions + layers if not re.search(rf"`{n}\b", card)] == []
