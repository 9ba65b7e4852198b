"""Loads one built variant through `kernels.get_local_kernel` the way a user does and
fails on anything loading it reports: a logged warning, a Python warning, or text on
the process's stderr (kernels' Rust code prints there). Run by `python -m builder --release`
inside each release environment (its torch and kernels), standalone:

    python builder/load_check.py BUILD_ROOT BACKEND EXPECTED_VARIANT

Prints one JSON line: the kernels version, the variant loaded and what was reported."""

import json
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path


def main() -> int:
    root, backend, expected = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    reported: list[str] = []
    # torch first, outside the check: what importing it says (e.g. torch 2.15 without
    # numpy warns) is the environment's, not the kernel's.
    import torch  # noqa: F401

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                reported.append(f"log {record.levelname} {record.name}: {record.getMessage()}")

    logging.getLogger().addHandler(Collect())
    with tempfile.TemporaryFile(mode="w+b") as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                import kernels
                from kernels import get_local_kernel

                module = get_local_kernel(root, backend=backend)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        printed = err.read().decode(errors="replace").strip()
    reported += [f"warning {w.category.__name__}: {w.message}" for w in caught]
    if printed:
        reported.append(f"stderr: {printed}")
    loaded = Path(module.__file__).parent.name
    if loaded != expected:
        reported.append(f"kernels picked {loaded}, not {expected}")
    print(json.dumps({"kernels": kernels.__version__, "variant": loaded, "reported": reported}))
    return 1 if reported else 0


if __name__ == "__main__":
    sys.exit(main())
