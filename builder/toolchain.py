"""Finds what a build needs (torch, Python headers, nvcc, a C++ compiler) and names the
variant folder exactly as the `kernels` library looks for it."""

from __future__ import annotations

import ast
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path


class ToolchainError(Exception):
    """Something the build needs is missing; the message says what to do."""


@dataclass(frozen=True)
class Torch:
    version: tuple[int, int]
    cuda: str | None  # e.g. "13.0" for a CUDA build of torch
    cxx11_abi: bool
    include_dirs: tuple[Path, ...]
    lib_dir: Path
    release: str = ""  # the whole version, e.g. "2.15.0+cu132"


@dataclass(frozen=True)
class Nvcc:
    path: Path
    version: tuple[int, int]
    cuda_home: Path

    @property
    def cuda(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


def _assigned_strings(path: Path) -> dict[str, str | None]:
    """Top-level `name = "literal"` (or None) assignments of a Python file, unexecuted."""
    values: dict[str, str | None] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        else:
            continue
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            values[target.id] = node.value.value
    return values


def torch_at(package: Path) -> Torch:
    """What a build needs to know of the torch package at `package` (its torch/ folder),
    read from its files without importing it: importing a CUDA build of torch needs its
    nvidia-* libraries, which a build does not (a release environment may lack them)."""
    version_py = package / "version.py"
    if not version_py.is_file():
        raise ToolchainError(f"{package} is not a torch package (no version.py)")
    info = _assigned_strings(version_py)
    release = str(info.get("__version__") or "")
    m = re.match(r"(\d+)\.(\d+)", release)
    if not m:
        raise ToolchainError(f"cannot read torch's version from {version_py}: {release!r}")
    lib_dir = package / "lib"
    c10 = lib_dir / "libc10.so"
    if not c10.is_file():
        raise ToolchainError(f"{c10} is missing: the torch install at {package} is incomplete")
    # libstdc++'s new ABI puts std::string in namespace std::__cxx11; an old-ABI build has
    # no such names (torch.compiled_with_cxx11_abi() says the same, after an import).
    cxx11_abi = b"__cxx11" in c10.read_bytes()
    return Torch(
        version=(int(m.group(1)), int(m.group(2))),
        cuda=info.get("cuda"),
        cxx11_abi=cxx11_abi,
        include_dirs=(package / "include", package / "include" / "torch" / "csrc" / "api" / "include"),
        lib_dir=lib_dir,
        release=release,
    )


def find_torch(site_packages: Path | None = None) -> Torch:
    """The torch this interpreter would import, or the one in `site_packages`."""
    if site_packages is not None:
        return torch_at(site_packages / "torch")
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise ToolchainError(
            "torch is not importable; install it in this interpreter first "
            "(./dev sets up .venv with the pinned torch)"
        )
    return torch_at(Path(spec.origin).parent)


def python_include() -> Path:
    inc = Path(sysconfig.get_paths()["include"])
    if not (inc / "Python.h").is_file():
        raise ToolchainError(f"Python.h not found in {inc}: install the Python development headers")
    return inc


def find_cxx() -> str:
    """$LTX_CXX, else g++ (or c++) from PATH. $CXX is not used on purpose: on some images
    (the H200 one) it names a toolchain that links libstdc++ into the extension, and a
    private libstdc++ beside torch's crashes the first time an error message is built."""
    cxx = os.environ.get("LTX_CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise ToolchainError("no C++ compiler: install g++ (or set LTX_CXX)")
    return cxx


def needed_libraries(so_path: Path) -> list[str] | None:
    """DT_NEEDED entries of a shared object; None when readelf is unavailable."""
    if not shutil.which("readelf"):
        return None
    out = subprocess.run(["readelf", "-d", str(so_path)], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def find_nvcc() -> Nvcc | None:
    """nvcc from $CUDA_HOME, /usr/local/cuda or PATH; None when there is none. The
    CUDA root is the folder above bin/ that holds lib64/libcudart.so."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    if shutil.which("nvcc"):
        candidates.append(Path(shutil.which("nvcc")))
    for path in candidates:
        path = path.resolve()
        if not path.is_file():
            continue
        cuda_home = path.parent.parent
        if not (cuda_home / "lib64" / "libcudart.so").exists():
            continue
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release (\d+)\.(\d+)", out)
        if not m:
            raise ToolchainError(f"cannot read the version of {path}: {out.strip()!r}")
        return Nvcc(path, (int(m.group(1)), int(m.group(2))), cuda_home)
    return None


def variant_name(torch: Torch, backend: str, cuda: str | None = None) -> str:
    """`torch<MAJ><MIN>-cxx11-<cu<VER>|cpu>-<arch>-linux`: the legacy variant name, the one
    every `kernels` release reads (0.19 also reads `torch-2.14-cxx11-cuda-13.0-cpython-3.9-
    abi3-x86_64-linux`; 0.17 and 0.18 read only this). A CUDA variant is named after the
    toolkit that compiled it (`cuda`, nvcc's version; torch's own when not given): kernels
    loads a cu130 variant under any torch built for CUDA 13.0 or a later 13.x."""
    abi = "cxx11" if torch.cxx11_abi else "cxx98"
    if backend == "cuda":
        cuda = cuda or torch.cuda
        assert cuda is not None
        major, minor = cuda.split(".")[:2]
        compute = f"cu{major}{minor}"
    else:
        compute = "cpu"
    return f"torch{torch.version[0]}{torch.version[1]}-{abi}-{compute}-{platform.machine()}-linux"
