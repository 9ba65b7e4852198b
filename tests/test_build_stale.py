"""A stale build (sources changed after it was made) is detected and rebuilt: the
builder's cache recompiles exactly the objects whose source, any header the source
includes (from the compiler's depfile), or compile command changed, and keeps the rest.
Exercised on a two-file project so that it takes a second, not a full build."""

import sys

import pytest

from conftest import REPO

from builder.compile import Job, run_jobs
from builder.toolchain import ToolchainError, find_cxx


@pytest.fixture
def project(tmp_path):
    try:
        cxx = find_cxx()
    except ToolchainError:
        pytest.skip("no C++ compiler")
    (tmp_path / "shared.h").write_text("inline int shared() { return 1; }\n")
    (tmp_path / "a.cpp").write_text('#include "shared.h"\nint a() { return shared(); }\n')
    (tmp_path / "b.cpp").write_text("int b() { return 2; }\n")

    def jobs(*extra_flags):
        made = []
        for name in ("a", "b"):
            obj = tmp_path / "obj" / f"{name}.o"
            cmd = [cxx, "-O1", *extra_flags, "-MMD", "-MF", str(obj.with_suffix(".d")), "-c",
                   str(tmp_path / f"{name}.cpp"), "-o", str(obj)]
            made.append(Job(f"{name}.cpp", tmp_path / f"{name}.cpp", obj, cmd))
        return made
    return tmp_path, jobs


def rebuilt(jobs) -> set:
    return {r.job.label for r in run_jobs(jobs, workers=2, prefix="test") if not r.cached}


def test_unchanged_sources_are_not_rebuilt(project):
    _, jobs = project
    assert rebuilt(jobs()) == {"a.cpp", "b.cpp"}
    assert rebuilt(jobs()) == set()


def test_a_changed_source_is_rebuilt(project):
    root, jobs = project
    rebuilt(jobs())
    (root / "b.cpp").write_text("int b() { return 3; }\n")
    assert rebuilt(jobs()) == {"b.cpp"}


def test_a_changed_header_rebuilds_what_includes_it(project):
    root, jobs = project
    rebuilt(jobs())
    (root / "shared.h").write_text("inline int shared() { return 4; }\n")
    assert rebuilt(jobs()) == {"a.cpp"}


def test_a_changed_command_rebuilds_everything(project):
    _, jobs = project
    rebuilt(jobs())
    assert rebuilt(jobs("-DLTX_TEST_FLAG=1")) == {"a.cpp", "b.cpp"}


def test_a_deleted_header_forces_a_rebuild_and_fails_loudly(project):
    """A source whose recorded header is gone is compiled again (not served from cache),
    and the compiler's error surfaces."""
    from builder.compile import CompileError

    root, jobs = project
    rebuilt(jobs())
    (root / "shared.h").unlink()
    with pytest.raises(CompileError, match="shared.h"):
        rebuilt(jobs())


@pytest.mark.rebuilds_build_folder
def test_the_build_folder_is_rebuilt_from_current_sources():
    """A shipped file that differs from its source (edited after the build, or left by
    an older build) is replaced by the next build: the package is copied afresh."""
    import subprocess

    from test_build_layout import expected_variant

    folder = REPO / "build" / expected_variant("cpu")
    stale = folder / "layers.py"
    stale.write_text(stale.read_text() + "\nSTALE = True\n")
    proc = subprocess.run([sys.executable, "-m", "builder", "--backend", "cpu"], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert stale.read_text() == (REPO / "torch-ext" / "ltx_kernels" / "layers.py").read_text()
