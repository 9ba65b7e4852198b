"""ltx-kernels in a few lines: load the build through `kernels`, as users do, and run
RMSNorm against PyTorch. On a machine without a GPU it loads the CPU variant.

    ./dev example      # builds first; or: python example.py after `python -m builder`
"""

import time
from pathlib import Path

import torch
from kernels import get_local_kernel

REPO = Path(__file__).resolve().parent


def timed(fn, repeats):
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def main():
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    # With a CUDA build of torch but no GPU, ask for the CPU variant explicitly.
    kernel = get_local_kernel(REPO, backend=None if on_gpu else "cpu")
    print(f"loaded {kernel.__name__} from {Path(kernel.__file__).parent.name} on {device}")

    rows, dim = (8192, 4096) if on_gpu else (2048, 4096)
    dtype = torch.bfloat16
    x = torch.randn(rows, dim, device=device, dtype=dtype)
    weight = torch.randn(dim, device=device, dtype=dtype)

    y = kernel.rms_norm(x, weight, eps=1e-6)
    reference = torch.nn.functional.rms_norm(x.double(), (dim,), weight.double(), 1e-6)
    err = (y.double() - reference).abs().max().item()
    print(f"rms_norm {rows}x{dim} {dtype}: max abs error vs fp64 = {err:.2e}")

    repeats = 200 if on_gpu else 20
    ours = timed(lambda: kernel.rms_norm(x, weight, 1e-6), repeats)
    torch_ = timed(lambda: torch.nn.functional.rms_norm(x, (dim,), weight, 1e-6), repeats)
    print(f"time per call: ltx-kernels {ours:.1f} us, F.rms_norm {torch_:.1f} us "
          f"({torch_ / ours:.2f}x)")


if __name__ == "__main__":
    main()
