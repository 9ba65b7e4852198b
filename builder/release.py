"""The release build's environments: one virtual environment per torch release under
.release-envs/torch-<version>/ (ignored by git), created once and reused, holding that
torch (the build compiles and links against its headers and libraries) and the kernels
release users get (each variant is loaded through it before the release build passes).

pip there follows the machine's settings except one: the environment passes its own
constraints file (PIP_CONSTRAINT, which takes precedence over a pip.conf `constraint`),
so a machine-wide cap on torch does not apply to it. Nothing of the machine's pip
configuration is changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .toolchain import ToolchainError

# The torch releases a release build targets; `--torch` overrides them.
RELEASE_TORCH = ("2.14.1", "2.15.0")
# The kernels release each variant must load under without a warning (what pip gives users).
RELEASE_KERNELS = "0.19.1"
READY = ".ltx-release-env"


@dataclass(frozen=True)
class ReleaseEnv:
    path: Path
    torch: str

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        found = sorted(self.path.glob("lib/python3*/site-packages"))
        if not found:
            raise ToolchainError(f"{self.path} has no lib/python3*/site-packages")
        return found[0]


def requirements(torch_version: str) -> list[str]:
    return [f"torch=={torch_version}", f"kernels=={RELEASE_KERNELS}"]


def ensure_env(root: Path, torch_version: str) -> ReleaseEnv:
    """The environment for `torch_version`, created (or completed) when it is not ready."""
    env = ReleaseEnv(root / ".release-envs" / f"torch-{torch_version}", torch_version)
    wanted = "\n".join(requirements(torch_version)) + "\n"
    marker = env.path / READY
    if marker.is_file() and marker.read_text() == wanted and env.python.is_file():
        return env
    rel = env.path.relative_to(root)
    print(f"[release] setting up {rel}: {', '.join(requirements(torch_version))}", flush=True)
    start = time.monotonic()
    if not env.python.is_file():
        shutil.rmtree(env.path, ignore_errors=True)
        # The base interpreter, not a virtual environment the builder may run in.
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(env.path)], check=True)
    constraints = env.path / "constraints.txt"
    constraints.write_text(f"torch=={torch_version}\n")
    pip_env = {**os.environ, "PIP_CONSTRAINT": str(constraints), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run([str(env.python), "-m", "pip", "install", "--quiet", *requirements(torch_version)],
                          env=pip_env, capture_output=True, text=True)
    if proc.returncode != 0:
        noise = "is ignored: it is neither a file nor a directory"
        log = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if noise not in line)
        raise ToolchainError(f"installing {' '.join(requirements(torch_version))} into {rel} failed:\n{log[-4000:]}")
    marker.write_text(wanted)
    size = sum(p.stat().st_size for p in env.path.rglob("*") if p.is_file() and not p.is_symlink())
    print(f"[release] {rel} ready in {time.monotonic() - start:.0f}s ({size / 2**30:.1f} GiB)", flush=True)
    return env


def check_load(env: ReleaseEnv, build_root: Path, backend: str, variant: str) -> str:
    """Loads `variant` under the environment's torch and kernels; raises on any warning."""
    script = Path(__file__).resolve().parent / "load_check.py"
    proc = subprocess.run([str(env.python), str(script), str(build_root), backend, variant],
                          capture_output=True, text=True, cwd=build_root)
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise ToolchainError(f"loading {variant} under torch {env.torch} failed:\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        found = "\n".join(f"  {r}" for r in result["reported"])
        raise ToolchainError(f"kernels {result['kernels']} under torch {env.torch} does not load {variant} "
                             f"cleanly:\n{found}")
    return result["kernels"]
