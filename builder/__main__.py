"""The project's offline builder: build.toml -> build/<variant>/, as `kernels` loads it.

    python -m builder                 # every variant this machine can build, installed torch
    python -m builder --backend cpu   # only the CPU variant
    python -m builder --clean         # forget cached objects first
    python -m builder --release       # CPU and CUDA variants for each release torch
    python -m builder --release --torch 2.15.0   # ... for the torch releases named

It does what `nix run .#build-and-copy` does for users with Nix, without Nix: reads
build.toml (kernel-builder edition 6; refuses what kernel-builder would refuse),
compiles the CUDA variant (SASS for each of build.toml's cuda-capabilities, PTX for
those written "+PTX") and the CPU variant against torch with the Python limited API,
generates registration.h, _ops.py and metadata.json (with the digest kernels checks),
and refuses to finish if a kernel spills on any arch or a .so fails the ABI check.

By default it builds against the torch of the interpreter that runs it. --release builds
against each torch of builder.release.RELEASE_TORCH instead (2.14.1 and 2.15.0), each in
its own environment under .release-envs/ (created once, reused; it also holds the
kernels release users get), needs both variants of each, and loads every variant there
through kernels, failing on any warning. Variant folders keep the legacy names
(torch215-cxx11-cu130-x86_64-linux), the names every kernels release reads."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

if sys.version_info < (3, 11):
    sys.exit("builder: needs Python >= 3.11 (for tomllib); the built kernels load on 3.9+")

from . import digest, generate, release
from .compile import CompileError, Job, link, run_jobs
from .config import BuildConfig, ConfigError, load_config, split_capability
from .toolchain import (Nvcc, Torch, ToolchainError, find_cxx, find_nvcc, find_torch,
                        needed_libraries, python_include, variant_name)

ROOT = Path(__file__).resolve().parent.parent
ABI_SHIM = Path(__file__).resolve().parent / "abi_shim"
MANYLINUX = "manylinux_2_28"
PYTHON_ABI = "3.9"


def source_uid(root: Path) -> str:
    """7 hex chars of the commit, `_dirty` when shipped sources differ from it."""
    shipped = ["build.toml", "kernel_src", "torch-ext"]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *shipped], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("_dirty" if dirty else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        h = hashlib.sha256()
        for top in shipped:
            for p in sorted((root / top).rglob("*")) if (root / top).is_dir() else [root / top]:
                if p.is_file() and "__pycache__" not in p.parts:
                    h.update(p.read_bytes())
        return h.hexdigest()[:7]


def write_if_changed(path: Path, text: str) -> None:
    """Keep mtimes and stamps of unchanged generated files."""
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def gencode_flags(caps: tuple[str, ...]) -> list[str]:
    """SASS for every capability; PTX as well only for those written "X.Y+PTX"
    (kernel-builder's rule)."""
    flags = []
    for cap in caps:
        bare, ptx = split_capability(cap)
        sm = bare.replace(".", "")
        code = f"[sm_{sm},compute_{sm}]" if ptx else f"sm_{sm}"
        flags += ["-gencode", f"arch=compute_{sm},code={code}"]
    return flags


def arch_label(caps: tuple[str, ...]) -> str:
    """"sm_75 sm_80 sm_90+PTX" for ("7.5", "8.0", "9.0+PTX")."""
    return " ".join("sm_" + cap.replace(".", "") for cap in caps)


def compile_jobs(cfg: BuildConfig, torch: Torch, nvcc: Nvcc | None, backend: str, ext: str,
                 cache: Path, caps: tuple[str, ...] | None = None) -> list[Job]:
    """One compile per source of the variant (caps: build.toml's unless given)."""
    gen_dir = cache / "generated"
    write_if_changed(gen_dir / "registration.h", generate.registration_header())

    includes = [f"-I{ABI_SHIM}", f"-I{gen_dir}", f"-I{cfg.root / 'torch-ext'}"]
    includes += list(dict.fromkeys(f"-I{cfg.root / d}" for d in cfg.torch_include))
    includes += list(dict.fromkeys(f"-I{cfg.root / d}" for k in cfg.kernels_for(backend) for d in k.include))
    for d in (*torch.include_dirs, python_include()):
        includes += ["-isystem", str(d)]
    defines = [f"-D{backend.upper()}_KERNEL", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.cxx11_abi)}",
               "-DPy_LIMITED_API=0x03090000"]

    sources = list(dict.fromkeys(
        [s for s in cfg.torch_src if s.endswith((".cpp", ".cc"))]
        + [s for k in cfg.kernels_for(backend) for s in k.compiled_sources]))
    caps = cfg.capabilities() if caps is None else caps
    cxx = find_cxx()
    jobs = []
    for src in sources:
        obj = cache / "obj" / (src.replace("/", "__") + ".o")
        extra = [f"-DTORCH_EXTENSION_NAME={ext}"] if src in cfg.torch_src else []
        common = ["-std=c++20", "-O3", "-MMD", "-MF", str(obj.with_suffix(".d")),
                  *defines, *extra, *includes, "-c", str(cfg.root / src), "-o", str(obj)]
        if src.endswith(".cu"):
            assert nvcc is not None
            # nvcc compiles the archs in parallel, one thread each, up to the machine's cores
            # (a count fixed per machine keeps the command, and so the cache, stable).
            threads = min(len(caps), os.cpu_count() or 1)
            cmd = [str(nvcc.path), f"-ccbin={cxx}", *gencode_flags(caps), "-Xptxas=-v", "-lineinfo",
                   f"--threads={threads}", "-Xcompiler=-fPIC", *common]
            label = f"{src}  {arch_label(caps)}"
        else:
            cmd = [cxx, "-fPIC", "-Wall", "-Wno-unknown-pragmas", *common]
            label = src
        jobs.append(Job(label, cfg.root / src, obj, cmd))
    return jobs


def build_variant(cfg: BuildConfig, torch: Torch, nvcc: Nvcc | None, backend: str,
                  uid: str, workers: int, cache_root: Path | None = None, verbose: bool = False) -> Path:
    variant = variant_name(torch, backend, nvcc.cuda if backend == "cuda" and nvcc else None)
    cache = (cache_root or cfg.root / ".build-cache") / variant
    ext = generate.extension_name(cfg, backend, uid)
    results = run_jobs(compile_jobs(cfg, torch, nvcc, backend, ext, cache), workers, backend,
                       register_log=cache / "registers.txt", verbose=verbose)
    cxx = find_cxx()

    so_name = f"{ext}.abi3.so"
    so_path = cache / so_name
    libs = [f"-L{torch.lib_dir}", "-lc10", "-ltorch", "-ltorch_cpu"]
    if backend == "cuda":
        assert nvcc is not None
        # Shared cudart: the static one drags in symbols newer than manylinux_2_28.
        libs += ["-lc10_cuda", "-ltorch_cuda", f"-L{nvcc.cuda_home / 'lib64'}", "-lcudart"]
    link([r.job.obj for r in results], so_path, [cxx], libs)
    check_shared_libstdcxx(so_path, cxx)
    check_abi(so_path)

    # Assemble in a fresh folder, then swap it in: no stale .so of an older uid survives.
    out_dir = cfg.root / "build" / variant
    tmp = out_dir.with_name(f".{variant}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(cfg.package_dir, tmp, ignore=shutil.ignore_patterns("__pycache__", "_ops.py"))
    shutil.copy2(so_path, tmp / so_name)
    (tmp / "_ops.py").write_text(generate.ops_py(ext))
    # metadata.json last: its digest covers every other file of the folder.
    (tmp / "metadata.json").write_text(generate.metadata_json(cfg, backend, ext, digest.hash_variant(tmp)))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def check_shared_libstdcxx(so_path: Path, cxx: str) -> None:
    """The extension must use the process's libstdc++ (torch's), never a private copy."""
    needed = needed_libraries(so_path)
    if needed is not None and not any(n.startswith("libstdc++.so") for n in needed):
        raise ToolchainError(
            f"{cxx} linked libstdc++ statically into {so_path.name} (it needs {needed}); "
            "a private libstdc++ beside torch's breaks exceptions: set LTX_CXX to a g++ "
            "that links it dynamically (the system g++)")


def check_abi(so_path: Path) -> None:
    if os.environ.get("LTX_SKIP_ABI_CHECK") == "1":
        # For images with a newer glibc than manylinux_2_28 (the H200 image): such a
        # build is for testing on that machine only, never for shipping.
        print(f"[abi] {so_path.name}: check skipped (LTX_SKIP_ABI_CHECK=1)", flush=True)
        return
    try:
        from kernel_abi_check import ObjectFile
    except ImportError as e:
        raise ToolchainError("kernel_abi_check is not importable: pip install kernel-abi-check==0.14.1") from e
    obj = ObjectFile(so_path)
    violations = list(obj.check_manylinux(MANYLINUX)) + list(obj.check_python_abi(PYTHON_ABI))
    if violations:
        lines = "\n".join(f"  {v}" for v in violations)
        raise CompileError(f"ABI check ({MANYLINUX}, Python {PYTHON_ABI}) failed for {so_path.name}:\n{lines}")
    print(f"[abi] {so_path.name}: {MANYLINUX} and Python {PYTHON_ABI} limited API OK", flush=True)


def choose_backends(cfg: BuildConfig, torch: Torch, nvcc: Nvcc | None, requested: str) -> list[str]:
    wanted = list(cfg.backends) if requested in ("auto", "all") else [requested]
    if requested not in ("auto", "all") and requested not in cfg.backends:
        raise ConfigError(f"backend {requested!r} is not in build.toml's backends {list(cfg.backends)}")
    if "cuda" not in wanted:
        return wanted
    reason = None
    if torch.cuda is None:
        reason = "torch is a CPU-only build (install a CUDA build of torch for the CUDA variant)"
    elif nvcc is None:
        reason = "no nvcc found (set CUDA_HOME or put nvcc on PATH for the CUDA variant)"
    elif nvcc.version[0] != int(torch.cuda.split(".")[0]):
        reason = (f"nvcc {nvcc.cuda} does not match torch's CUDA {torch.cuda} "
                  "(the major versions must agree)")
    elif nvcc.version[1] > int(torch.cuda.split(".")[1]):
        # The variant is named after nvcc's CUDA (cu<nvcc>); kernels loads it only under a
        # torch built for that CUDA or a later minor release of it.
        reason = (f"nvcc {nvcc.cuda} is newer than torch's CUDA {torch.cuda}: kernels would not load a "
                  f"cu{nvcc.cuda.replace('.', '')} variant under this torch (use a CUDA {torch.cuda} toolkit)")
    if reason is None:
        return wanted
    if requested == "cuda" or requested == "all":
        raise ToolchainError(f"cannot build the CUDA variant: {reason}")
    print(f"[builder] building the CPU variant only: {reason}", flush=True)
    return [b for b in wanted if b != "cuda"]


def build_release(cfg: BuildConfig, nvcc: Nvcc | None, uid: str, workers: int,
                  torch_versions: list[str]) -> None:
    """Both variants for each torch release, each against the torch of its own environment,
    then each loaded there through kernels: any warning fails the build."""
    built = []
    for version in torch_versions:
        env = release.ensure_env(ROOT, version)
        torch = find_torch(env.site_packages)
        if torch.release.split("+")[0] != version:
            raise ToolchainError(f"{env.path} holds torch {torch.release}, not {version}: delete it to recreate it")
        if reason := cfg.torch_supported(torch.version):
            raise ConfigError(reason)
        for backend in choose_backends(cfg, torch, nvcc, "all"):
            start = time.monotonic()
            out = build_variant(cfg, torch, nvcc, backend, uid, workers,
                                cache_root=ROOT / ".build-cache" / "release" / f"torch-{version}")
            kernels_version = release.check_load(env, ROOT, backend, out.name)
            print(f"[release] {out.relative_to(ROOT)} ready in {time.monotonic() - start:.0f}s "
                  f"(torch {torch.release}; loads under kernels {kernels_version} with no warning)", flush=True)
            built.append(out.name)
    print("[release] built: " + ", ".join(built), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m builder", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["auto", "all", "cuda", "cpu"], default="auto",
                        help="auto: every backend this machine can build (default); all: fail if one cannot")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    parser.add_argument("--clean", action="store_true", help="delete cached objects and build/ first")
    parser.add_argument("--verbose", action="store_true",
                        help="print each kernel's registers and spills per arch "
                             "(always written to .build-cache/<variant>/registers.txt)")
    parser.add_argument("--release", action="store_true",
                        help=f"build both variants for each release torch ({', '.join(release.RELEASE_TORCH)}), "
                             "each in its own environment under .release-envs/, and check each loads")
    parser.add_argument("--torch", action="append", metavar="VERSION",
                        help="with --release: a torch release to build for instead (repeatable)")
    args = parser.parse_args(argv)
    if args.torch and not args.release:
        parser.error("--torch needs --release (the default build uses this interpreter's torch)")
    if args.release and args.backend != "auto":
        parser.error("--release builds every backend of build.toml; leave --backend out")
    try:
        cfg = load_config(ROOT)
        nvcc = find_nvcc()
        if args.clean:
            shutil.rmtree(ROOT / ".build-cache", ignore_errors=True)
            shutil.rmtree(ROOT / "build", ignore_errors=True)
        uid = source_uid(ROOT)
        if args.release:
            build_release(cfg, nvcc, uid, args.jobs, args.torch or list(release.RELEASE_TORCH))
            return 0
        torch = find_torch()
        if reason := cfg.torch_supported(torch.version):
            raise ConfigError(reason)
        backends = choose_backends(cfg, torch, nvcc, args.backend)
        for backend in backends:
            start = time.monotonic()
            out = build_variant(cfg, torch, nvcc, backend, uid, args.jobs, verbose=args.verbose)
            print(f"[builder] {out.relative_to(ROOT)} ready in {time.monotonic() - start:.0f}s", flush=True)
    except (ConfigError, ToolchainError, CompileError) as e:
        print(f"builder: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
