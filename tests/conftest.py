"""Loads the built variants through `kernels`, the way users load them.

Each test that takes `kernel` and `device` runs once per (variant, device) pair this
machine has: the CPU variant on CPU tensors; the CUDA variant's CPU twins on CPU
tensors (whenever torch is a CUDA build); the CUDA variant on the GPU (when one is
present; skipped without a GPU). Build first: `python -m builder`.
"""

import fcntl
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
HAS_GPU = torch.cuda.is_available()

# (variant backend, tensor device)
TARGETS = [("cpu", "cpu")]
if torch.version.cuda is not None:
    TARGETS += [("cuda", "cpu"), ("cuda", "cuda")]


def load_variant(backend: str):
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


@contextmanager
def _build_folder_held(exclusive: bool):
    """Parallel test processes (pytest -n, .ci/gpu's groups) share build/. Every test holds
    it shared; a test that damages and rebuilds it holds it alone, closing the turnstile
    first so that a stream of shared holders cannot starve it."""
    locks = REPO / ".build-cache"
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
