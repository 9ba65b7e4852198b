"""What the launch-variants harnesses share (rope_variants.py, norm_variants.py): building
their .cu (which includes a kernel_src/ .cuh and registers a torch op library) with nvcc
against this python's torch, as a shared library to load or (check_only) a cubin that
proves it compiles. They time candidates with harness.time_and_print."""

import hashlib
import subprocess
from pathlib import Path

import torch

from builder.toolchain import find_nvcc, find_torch, python_include

REPO = Path(__file__).resolve().parents[2]


def build(source: Path, sm: str, out_dir: Path, check_only: bool = False) -> tuple[Path, list[str]]:
    """The library (or cubin) and ptxas's lines for kernels that spill."""
    nvcc, torch_build = find_nvcc(), find_torch()
    if nvcc is None:
        raise SystemExit("no nvcc found (set CUDA_HOME or put nvcc on PATH)")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / (f"{source.stem}_sm{sm}" + (".cubin" if check_only else ".so"))
    partial = target.with_name(target.name + ".partial")  # renamed when nvcc is done: never a half-written library
    includes = [f"-I{d}" for d in (*torch_build.include_dirs, python_include(), REPO / "kernel_src")]
    cmd = [str(nvcc.path), f"-arch=sm_{sm}", "-std=c++20", "-O3", "-DCUDA_KERNEL",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch_build.cxx11_abi)}", *includes, "-Xptxas=-v", "-o", str(partial)]
    if check_only:
        cmd += ["-cubin", str(source)]
    else:
        cmd += ["-shared", "-Xcompiler=-fPIC", str(source), f"-L{torch_build.lib_dir}",
                "-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cpu", "-ltorch_cuda"]
    digest = sources_digest(source, sm)  # of what nvcc reads
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"nvcc failed:\n{result.stderr[-4000:]}")
    partial.replace(target)
    if not check_only:
        target.with_name(target.name + ".sha256").write_text(digest)
    spills = [line for line in result.stderr.splitlines() if "spill" in line and " 0 bytes spill stores" not in line]
    return target, spills


def library_path(source: Path, sm: str) -> Path:
    return REPO / ".build-cache" / source.stem / f"{source.stem}_sm{sm}.so"


def sources_digest(source: Path, sm: str) -> str:
    """The harness, every kernel_src/ file it may include, the arch and torch: what the
    library is built from (contents, not times: a copied tree keeps its library)."""
    digest = hashlib.sha256(f"{sm} {torch.__version__}".encode())
    for path in [source, *sorted((REPO / "kernel_src").iterdir())]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def up_to_date(library: Path, source: Path, sm: str) -> bool:
    """Built from the sources as they are now (the digest its build wrote beside it)."""
    stamp = library.with_name(library.name + ".sha256")
    return library.exists() and stamp.exists() and stamp.read_text() == sources_digest(source, sm)


def load(source: Path) -> None:
    """Builds the harness for this GPU's arch into .build-cache/<name> (minutes of nvcc; a
    library built from the same sources is taken as it is) and loads its ops
    (torch.ops.<name>), warning when a kernel spills: its timings then suffer."""
    major, minor = torch.cuda.get_device_capability()
    sm = f"{major}{minor}"
    library = library_path(source, sm)
    if up_to_date(library, source, sm):
        print(f"{library.name}: built already")
    else:
        library, spills = build(source, sm, library.parent)
        if spills:
            print(f"warning: {len(spills)} kernels spill (their variants' timings suffer)")
    torch.ops.load_library(str(library))
