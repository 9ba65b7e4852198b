"""Loads the built variants through `kernels`, the way users load them.

Each test that takes `kernel` and `device` runs once per (variant, device) pair this
machine has: the CPU variant on CPU tensors; the CUDA variant's CPU twins on CPU
tensors (whenever torch is a CUDA build); the CUDA variant on the GPU (when one is
present; skipped without a GPU). Build first: `python -m builder`.

Under kernel-builder's `nix run .#ci-test` (and `.ci/run`'s imitation of it) the tests
run from a copy of this folder with `LOCAL_KERNELS=<repo-id>=<build>` and `-m kernels_ci`:
the kernel is then loaded with `get_kernel(<repo-id>, version=1)` from that build, and
only the variants it holds are targets.
"""

import fcntl
import os
import tempfile
import tomllib
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
HAS_GPU = torch.cuda.is_available()
_GENERAL = tomllib.loads((REPO / "build.toml").read_text())["general"]
REPO_ID, VERSION = _GENERAL["hub"]["repo-id"], _GENERAL["version"]


def _local_override() -> Path | None:
    """The build LOCAL_KERNELS names for this kernel, as kernels parses the variable."""
    for entry in filter(None, os.environ.get("LOCAL_KERNELS", "").split(":")):
        repo_id, _, path = entry.partition("=")
        if repo_id == REPO_ID:
            return Path(path)
    return None


LOCAL_BUILD = _local_override()


def _built_backends(build: Path) -> set[str]:
    return {"cpu" if "-cpu-" in v.name else "cuda" for v in build.iterdir() if v.is_dir()}


# (variant backend, tensor device)
TARGETS = [("cpu", "cpu")]
if torch.version.cuda is not None:
    TARGETS += [("cuda", "cpu"), ("cuda", "cuda")]
if LOCAL_BUILD is not None:
    TARGETS = [t for t in TARGETS if t[0] in _built_backends(LOCAL_BUILD)]


def load_variant(backend: str):
    if LOCAL_BUILD is not None:
        from kernels import get_kernel

        return get_kernel(REPO_ID, version=VERSION, backend=backend)
    from kernels import get_local_kernel

    return get_local_kernel(REPO, backend=backend)


@pytest.fixture(params=TARGETS, ids=[f"{b}-variant-on-{d}" for b, d in TARGETS])
def target(request):
    backend, device = request.param
    if device == "cuda" and not HAS_GPU:
        pytest.skip("no GPU on this machine (these run on the device)")
    return load_variant(backend), device


@pytest.fixture
def kernel(target):
    return target[0]


@pytest.fixture
def device(target):
    return target[1]


def pytest_configure(config):
    config.addinivalue_line("markers", "rebuilds_build_folder: damages and rebuilds build/; runs alone")
    config.addinivalue_line("markers", "kernels_ci: proves a build (kernel-builder's ci-test runs these)")


@contextmanager
def _build_folder_held(exclusive: bool):
    """Parallel test processes (pytest -n, .ci/gpu's groups) share build/. Every test holds
    it shared; a test that damages and rebuilds it holds it alone, closing the turnstile
    first so that a stream of shared holders cannot starve it."""
    # A ci-test copy of the tests may be read-only and has no build/ to share.
    locks = REPO / ".build-cache" if LOCAL_BUILD is None else Path(tempfile.gettempdir())
    locks.mkdir(exist_ok=True)
    with open(locks / "tests.turnstile", "a") as turnstile, open(locks / "tests.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield


@pytest.fixture(autouse=True)
def _build_folder(request):
    with _build_folder_held(exclusive=request.node.get_closest_marker("rebuilds_build_folder") is not None):
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
