"""Finds what a build needs (torch, Python headers, nvcc, a C++ compiler) and names the
variant folder exactly as the `kernels` library looks for it."""

from __future__ import annotations

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


@dataclass(frozen=True)
class Nvcc:
    path: Path
    version: tuple[int, int]
    cuda_home: Path


def find_torch() -> Torch:
    try:
        import torch
    except ImportError as e:
        raise ToolchainError(
            f"torch is not importable ({e}); install it in this interpreter first "
            "(./dev sets up .venv with the pinned torch)"
        ) from e
    root = Path(torch.__file__).parent
    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    return Torch(
        version=(major, minor),
        cuda=torch.version.cuda,
        cxx11_abi=bool(torch.compiled_with_cxx11_abi()),
        include_dirs=(root / "include", root / "include" / "torch" / "csrc" / "api" / "include"),
        lib_dir=root / "lib",
    )


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


def variant_name(torch: Torch, backend: str) -> str:
    """`torch<MAJ><MIN>-cxx11-<cu<VER>|cpu>-<arch>-linux`, what `kernels` resolves."""
    abi = "cxx11" if torch.cxx11_abi else "cxx98"
    if backend == "cuda":
        assert torch.cuda is not None
        major, minor = torch.cuda.split(".")[:2]
        compute = f"cu{major}{minor}"
    else:
        compute = "cpu"
    return f"torch{torch.version[0]}{torch.version[1]}-{abi}-{compute}-{platform.machine()}-linux"
