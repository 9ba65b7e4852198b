"""benchmarks/benchmark.py is what `kernels benchmark` runs and what kernel-builder uploads:
it must work alone, beside nothing of this repository but the kernel it is given."""

import re
import shutil
import subprocess
import sys

import pytest

from conftest import LOCAL_BUILD, REPO


@pytest.mark.skipif(LOCAL_BUILD is not None, reason="needs this checkout's build/")
def test_workloads_verify_from_a_lone_copy_of_the_script(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    script = shutil.copy(REPO / "benchmarks" / "benchmark.py", tmp_path / "benchmarks")
    proc = subprocess.run([sys.executable, script, "--self-check", str(REPO)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed, failed = map(int, re.search(r"^(\d+) passed, (\d+) failed$", proc.stdout, re.M).groups())
    workloads = len(re.findall(r"^    def benchmark_\w+", (REPO / "benchmarks" / "benchmark.py").read_text(), re.M))
    assert (passed, failed) == (workloads, 0), proc.stdout
    assert "digest" not in proc.stderr, "the build's metadata.json must record its digest"
