"""The built variant folders are what `kernels` resolves and loads."""

import json
import re

import pytest
import torch

from conftest import REPO, TARGETS, load_variant

BACKENDS = sorted({b for b, _ in TARGETS})


def expected_variant(backend: str) -> str:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    compute = "cpu" if backend == "cpu" else "cu" + "".join(torch.version.cuda.split(".")[:2])
    return f"torch{major}{minor}-cxx11-{compute}-x86_64-linux"


@pytest.mark.parametrize("backend", BACKENDS)
def test_variant_folder_is_the_one_kernels_resolves(backend):
    from kernels.variants import get_variants_local, resolve_variant

    folder = REPO / "build" / expected_variant(backend)
    assert folder.is_dir(), f"{folder} missing: run `python -m builder` first"
    chosen, trace = resolve_variant(get_variants_local(REPO / "build"), backend)
    assert chosen is not None, trace
    assert chosen.variant_str == folder.name


@pytest.mark.parametrize("backend", BACKENDS)
def test_variant_contents_and_metadata(backend):
    from kernels._rust import Metadata

    folder = REPO / "build" / expected_variant(backend)
    raw = json.loads((folder / "metadata.json").read_text())
    meta = Metadata.read_from_file(folder / "metadata.json")
    assert str(meta.name) == "ltx-kernels" and meta.version == 1 and meta.license == "Apache-2.0"
    assert raw["python-depends"] == [] and raw["backend"]["type"] == backend
    if backend == "cuda":
        assert raw["backend"]["archs"] == ["7.5", "8.0", "9.0+PTX"]
    assert re.fullmatch(rf"_ltx_kernels_{backend}_[0-9a-f]{{7}}(_dirty)?", meta.id)

    so_files = sorted(p.name for p in folder.glob("*.so"))
    assert so_files == [f"{meta.id}.abi3.so"], "exactly one extension, named after the id"
    ops_py = (folder / "_ops.py").read_text()
    assert f"ops = torch.ops.{meta.id}" in ops_py
    package = {p.name for p in (REPO / "torch-ext" / "ltx_kernels").glob("*.py")}
    assert package <= {p.name for p in folder.glob("*.py")}


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
    import sys

    sys.path.insert(0, str(REPO))
    from builder.toolchain import needed_libraries

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
