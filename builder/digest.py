"""The digest `kernels` (0.18 and later) checks a variant's files against on every load,
as kernel-builder records it in metadata.json: without one, kernels warns that the
variant's integrity cannot be verified.

This is `Digest::hash_variant` of kernels-data (Rust), rewritten so that the builder
needs no `kernels` install: every file under the variant folder, by its path relative to
it (with "/"), hashed whole, base64 (standard alphabet, padded). Left out: the folder's
own metadata.json and metadata.json.sigstore (metadata.json holds the digest, and the
signature covers it), anything under a __pycache__ folder and any .pyc file (the
interpreter writes those after the download). Symbolic links are followed to the file
they name. tests/test_build_layout.py checks it equals `kernels._rust.Digest.hash_variant`
on a built variant."""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

ALGORITHMS = {"sha256": hashlib.sha256, "sha512": hashlib.sha512}
EXCLUDED_AT_TOP = ("metadata.json", "metadata.json.sigstore")


def hash_variant(variant: Path, algorithm: str = "sha256") -> dict:
    """{"algorithm": ..., "files": {relative path: base64 hash}}, metadata.json's `digest`."""
    new_hash = ALGORITHMS[algorithm]
    files: dict[str, str] = {}
    # As walkdir (followlinks=False): a linked folder is not entered, a linked file is hashed.
    for dirpath, _, filenames in os.walk(variant):
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(variant)
            if not path.resolve(strict=True).is_file():
                continue
            if len(rel.parts) == 1 and name in EXCLUDED_AT_TOP:
                continue
            # kernels tests every component of the whole path, the variant's own included.
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            files[rel.as_posix()] = base64.b64encode(new_hash(path.read_bytes()).digest()).decode()
    return {"algorithm": algorithm, "files": dict(sorted(files.items()))}
