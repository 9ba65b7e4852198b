"""The FP8 kernels divide without a division (kernel_src/fp8_cuda.cuh): the scale from the
row's amax by Markstein's step (every finite amax), the quotient by Markstein's step from a
correctly rounded reciprocal, and static scales through a double reciprocal. The host
program fp8_division_check.c runs the same fp32 / fp64 operations against IEEE division; the
GPU tests hold the kernels' bytes to the PyTorch reference quantizer."""
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_division_free_quantizer_arithmetic_matches_ieee_division(tmp_path):
    exe = tmp_path / "fp8_division_check"
    subprocess.run(["cc", "-O2", "-ffp-contract=off", str(REPO / "tests" / "fp8_division_check.c"), "-o", str(exe),
                    "-lm"], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    sys.stdout.write(run.stdout)
    rows = {name: (int(cases), int(bad)) for name, cases, bad in (line.split() for line in run.stdout.splitlines())}
    assert set(rows) == {"scale", "reciprocal", "dynamic", "static"}
    assert rows["scale"][0] > 1_000_000_000  # every finite float from 1e-12 up
    assert all(cases > 1_000_000 for cases, _ in rows.values())
    assert all(bad == 0 for _, bad in rows.values()), rows
    assert run.returncode == 0
