"""Reads and validates build.toml: the one source of truth for sources, backends and archs.

The file is kernel-builder's edition 6 format, the one `kernels._rust.Build.open` (the
parser kernel-builder itself uses, shipped in the `kernels` wheel) reads without a
warning. This reader accepts what that parser accepts and this builder can honour:

- the legacy formats (no `edition`, or `backend = ...` in a kernel section) are refused
  with the fix, as is an edition this builder does not know;
- a field kernel-builder does not know is refused, as kernel-builder refuses it;
- a field kernel-builder knows but this builder does not implement (e.g. `cuda-flags`)
  is refused too, rather than silently ignored.

Where `kernels` is importable, its parser reads the file as well (`check_with_kernels`),
so a difference between the two readers shows up as an error here, not on a Nix build."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tomllib  # the builder needs Python >= 3.11; the built package supports 3.9+

EDITION = 6
# Edition 6's `language` of a kernel section -> the backend (variant) it builds into.
LANGUAGES = {"cpp-cuda": "cuda", "cpp-cpu": "cpu"}
SUPPORTED_BACKENDS = tuple(LANGUAGES.values())
# What nvcc 13.0 compiles SASS for (`nvcc --list-gpu-code`): 7.5 (T4), 8.0 (A100),
# 8.6/8.7/8.8/8.9 (consumer Ampere, Orin, Ada), 9.0 (H100/H200), 10.0/10.3 (B200/B300),
# 11.0 (Thor), 12.0/12.1 (RTX 50xx, DGX Spark). An entry may end in "+PTX".
KNOWN_CAPABILITIES = ("7.5", "8.0", "8.6", "8.7", "8.8", "8.9", "9.0", "10.0", "10.3", "11.0", "12.0", "12.1")
PTX_SUFFIX = "+PTX"
NAME_PATTERN = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")
COMPILED_SUFFIXES = (".cu", ".cpp", ".cc")

# Every field edition 6 allows (kernel-builder rejects any other), and the subset this
# builder implements.
ROOT_TABLES = {"general", "torch", "kernel"}
GENERAL_FIELDS = {"name", "version", "edition", "license", "upstream", "source", "backends", "build-layout",
                  "cuda", "hub", "kernel-depends", "neuron", "python-depends", "tpu", "xpu"}
GENERAL_IMPLEMENTED = {"name", "version", "edition", "license", "backends", "hub", "python-depends"}
HUB_FIELDS = HUB_IMPLEMENTED = {"repo-id", "branch"}
TORCH_FIELDS = {"include", "minver", "maxver", "pyext", "src", "stable-abi", "cxx-flags"}
TORCH_IMPLEMENTED = {"include", "minver", "maxver", "src"}
KERNEL_FIELDS = {
    "cpp-cuda": {"language", "cuda-capabilities", "cuda-flags", "cuda-minver", "cxx-flags", "depends", "include", "src"},
    "cpp-cpu": {"language", "cxx-flags", "depends", "include", "src"},
}
KERNEL_IMPLEMENTED = {"language", "cuda-capabilities", "depends", "include", "src"}
KERNEL_DEPENDS = ("torch",)

LEGACY_FIX = ('set edition = 6 in [general] and write language = "cpp-cuda" (or "cpp-cpu") instead of '
              'backend = "cuda" (or "cpu") in each [kernel.*] section (kernel-builder update-build does this)')


class ConfigError(Exception):
    """build.toml is missing something or holds a value the builder cannot use."""


@dataclass(frozen=True)
class KernelSection:
    name: str
    backend: str
    src: tuple[str, ...]
    include: tuple[str, ...]
    capabilities: tuple[str, ...]  # as written, e.g. ("9.0", "12.0+PTX"); empty for cpu

    @property
    def compiled_sources(self) -> tuple[str, ...]:
        return tuple(s for s in self.src if s.endswith(COMPILED_SUFFIXES))


@dataclass(frozen=True)
class BuildConfig:
    root: Path
    name: str
    version: int
    license: str
    backends: tuple[str, ...]
    torch_src: tuple[str, ...]
    kernels: tuple[KernelSection, ...]
    torch_include: tuple[str, ...] = ()
    torch_minver: str | None = None
    torch_maxver: str | None = None
    python_depends: tuple[str, ...] = ()

    @property
    def python_name(self) -> str:
        return self.name.replace("-", "_")

    @property
    def package_dir(self) -> Path:
        return self.root / "torch-ext" / self.python_name

    def kernels_for(self, backend: str) -> tuple[KernelSection, ...]:
        return tuple(k for k in self.kernels if k.backend == backend)

    def capabilities(self) -> tuple[str, ...]:
        """The CUDA capabilities as build.toml writes them (every CUDA section lists the
        same), oldest first: SASS for each, PTX too for those ending in "+PTX"."""
        sections = self.kernels_for("cuda")
        return sections[0].capabilities if sections else ()

    def torch_supported(self, version: tuple[int, int]) -> str | None:
        """Why [torch] minver/maxver exclude a torch version; None when they allow it."""
        def parse(v: str) -> tuple[int, ...]:
            return tuple(int(p) for p in v.split("."))
        have = ".".join(map(str, version))
        if self.torch_minver and version < parse(self.torch_minver)[:2]:
            return f"torch {have} is older than build.toml's [torch] minver {self.torch_minver}"
        if self.torch_maxver and version > parse(self.torch_maxver)[:2]:
            return f"torch {have} is newer than build.toml's [torch] maxver {self.torch_maxver}"
        return None


def split_capability(cap: str) -> tuple[str, bool]:
    """"12.0+PTX" -> ("12.0", True); "9.0" -> ("9.0", False)."""
    if cap.endswith(PTX_SUFFIX):
        return cap[: -len(PTX_SUFFIX)], True
    return cap, False


def _require(table: dict, key: str, where: str, kind: type):
    if key not in table:
        raise ConfigError(f"build.toml: [{where}] lacks '{key}'")
    value = table[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"build.toml: [{where}] {key} must be a {kind.__name__}, got {value!r}")
    return value


def _string_list(table: dict, key: str, where: str, required: bool) -> tuple[str, ...]:
    if key not in table and not required:
        return ()
    values = _require(table, key, where, list)
    if not all(isinstance(v, str) for v in values):
        raise ConfigError(f"build.toml: [{where}] {key} must be a list of strings, got {values!r}")
    return tuple(values)


def _check_fields(table: dict, where: str, allowed: set[str], implemented: set[str]) -> None:
    for key in table:
        if key not in allowed:
            raise ConfigError(f"build.toml: [{where}] has unknown field '{key}' (edition {EDITION} allows "
                              f"{', '.join(sorted(allowed))}; kernel-builder refuses any other)")
        if key not in implemented:
            raise ConfigError(f"build.toml: [{where}] {key} is valid in edition {EDITION}, but the offline builder "
                              f"does not implement it: remove it, or build with kernel-builder (Nix)")


def _check_paths_exist(root: Path, paths: tuple[str, ...], where: str) -> None:
    for p in paths:
        if not (root / p).exists():
            raise ConfigError(f"build.toml: [{where}] names '{p}', which does not exist")


def _check_edition(raw: dict) -> None:
    general = raw.get("general")
    edition = general.get("edition") if isinstance(general, dict) else None
    kernels = raw.get("kernel") if isinstance(raw.get("kernel"), dict) else {}
    legacy_sections = [k for k, t in kernels.items() if isinstance(t, dict) and "backend" in t]
    if edition is None or (edition != EDITION and legacy_sections):
        what = "the legacy v4 format" if edition is None else f"edition {edition}"
        raise ConfigError(f"build.toml is {what}: {LEGACY_FIX}")
    if edition != EDITION:
        raise ConfigError(f"build.toml: [general] edition = {edition!r}; this builder reads edition {EDITION} "
                          f"(kernel-builder update-build upgrades older editions)")
    if legacy_sections:
        raise ConfigError(f"build.toml: [kernel.{legacy_sections[0]}] uses backend =, the legacy spelling: "
                          f"write language = \"cpp-cuda\" (or \"cpp-cpu\") instead (edition {EDITION})")


def load_config(root: Path) -> BuildConfig:
    path = root / "build.toml"
    if not path.is_file():
        raise ConfigError(f"no build.toml in {root}: run the builder from the repository root")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"build.toml does not parse: {e}") from e

    _check_edition(raw)
    for key in raw:
        if key not in ROOT_TABLES:
            raise ConfigError(f"build.toml: unknown table or field '{key}' at the top level "
                              f"(this builder reads {', '.join(sorted(ROOT_TABLES))})")

    general = _require(raw, "general", "root", dict)
    _check_fields(general, "general", GENERAL_FIELDS, GENERAL_IMPLEMENTED)
    name = _require(general, "name", "general", str)
    if not NAME_PATTERN.match(name):
        raise ConfigError(f"build.toml: [general] name must be lowercase and dash-separated, got {name!r}")
    version = _require(general, "version", "general", int)
    license_ = _require(general, "license", "general", str)
    backends = _string_list(general, "backends", "general", required=True)
    for b in backends:
        if b not in SUPPORTED_BACKENDS:
            raise ConfigError(f"build.toml: [general] backends has {b!r}; this builder knows {SUPPORTED_BACKENDS}")
    python_depends = _string_list(general, "python-depends", "general", required=False)
    if "hub" in general:
        hub = _require(general, "hub", "general", dict)
        _check_fields(hub, "general.hub", HUB_FIELDS, HUB_IMPLEMENTED)

    torch_table = _require(raw, "torch", "root", dict)
    _check_fields(torch_table, "torch", TORCH_FIELDS, TORCH_IMPLEMENTED)
    torch_src = _string_list(torch_table, "src", "torch", required=True)
    torch_include = _string_list(torch_table, "include", "torch", required=False)
    _check_paths_exist(root, torch_src + torch_include, "torch")
    bounds = {}
    for key in ("minver", "maxver"):
        if key in torch_table:
            bounds[key] = _require(torch_table, key, "torch", str)
            if not re.fullmatch(r"\d+\.\d+(\.\d+)?", bounds[key]):
                raise ConfigError(f"build.toml: [torch] {key} must be a version such as \"2.14\", got {bounds[key]!r}")

    kernel_tables = _require(raw, "kernel", "root", dict)
    kernels = []
    for kname, table in kernel_tables.items():
        where = f"kernel.{kname}"
        if not isinstance(table, dict):
            raise ConfigError(f"build.toml: kernel.{kname} must be a table ([kernel.{kname}])")
        language = _require(table, "language", where, str)
        if language not in LANGUAGES:
            raise ConfigError(f"build.toml: [{where}] language {language!r}: this builder knows "
                              f"{', '.join(repr(k) for k in LANGUAGES)}")
        _check_fields(table, where, KERNEL_FIELDS[language], KERNEL_IMPLEMENTED)
        backend = LANGUAGES[language]
        if backend not in backends:
            raise ConfigError(f"build.toml: [{where}] language {language!r} builds for {backend!r}, "
                              f"which is not in [general] backends {list(backends)}")
        depends = _string_list(table, "depends", where, required=True)
        for d in depends:
            if d not in KERNEL_DEPENDS:
                raise ConfigError(f"build.toml: [{where}] depends on {d!r}; this builder provides {KERNEL_DEPENDS}")
        src = _string_list(table, "src", where, required=True)
        include = _string_list(table, "include", where, required=False)
        _check_paths_exist(root, src + include, where)
        caps = _string_list(table, "cuda-capabilities", where, required=False)
        if backend == "cuda" and not caps:
            raise ConfigError(f"build.toml: [{where}] needs cuda-capabilities "
                              f"(e.g. [\"7.5\", \"8.0\", \"9.0+PTX\"])")
        for c in caps:
            if split_capability(c)[0] not in KNOWN_CAPABILITIES:
                raise ConfigError(f"build.toml: [{where}] cuda-capabilities has {c!r}; expected one of "
                                  f"{KNOWN_CAPABILITIES}, each optionally followed by {PTX_SUFFIX!r}")
        bare = [split_capability(c)[0] for c in caps]
        if len(set(bare)) != len(bare):
            raise ConfigError(f"build.toml: [{where}] cuda-capabilities lists a capability twice: {list(caps)}")
        caps = tuple(sorted(caps, key=lambda c: tuple(int(p) for p in split_capability(c)[0].split("."))))
        if backend == "cpu" and any(s.endswith(".cu") for s in src):
            raise ConfigError(f"build.toml: [{where}] is a cpu kernel but lists .cu sources")
        kernels.append(KernelSection(kname, backend, src, include, caps))
    for b in backends:
        if not any(k.backend == b for k in kernels):
            language = next(lang for lang, be in LANGUAGES.items() if be == b)
            raise ConfigError(f"build.toml: backend {b!r} is listed but no [kernel.*] section has "
                              f"language = {language!r}")
    cuda_caps = {k.capabilities for k in kernels if k.backend == "cuda"}
    if len(cuda_caps) > 1:
        listed = "; ".join(f"[kernel.{k.name}] {list(k.capabilities)}" for k in kernels if k.backend == "cuda")
        raise ConfigError("build.toml: the cpp-cuda sections list different cuda-capabilities "
                          f"({listed}): this builder compiles every .cu file for one set and records it in "
                          "metadata.json, so list the same capabilities in each")

    cfg = BuildConfig(root, name, version, license_, backends, torch_src, tuple(kernels), torch_include,
                      bounds.get("minver"), bounds.get("maxver"), python_depends)
    if not (cfg.package_dir / "__init__.py").is_file():
        raise ConfigError(f"no Python package at torch-ext/{cfg.python_name}/__init__.py")
    check_with_kernels(root)
    return cfg


@contextlib.contextmanager
def _stderr_captured():
    """Collects what is written to file descriptor 2 (kernels' Rust parser prints its
    warnings there, past Python's sys.stderr)."""
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        out: list[str] = []
        try:
            os.dup2(tmp.fileno(), 2)
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def check_with_kernels(root: Path) -> bool:
    """Reads build.toml with kernel-builder's own parser (`kernels._rust.Build`, in the
    kernels wheel since 0.18) when it is importable; an error or a warning from it fails
    the build. Returns whether the check ran: the builder works without kernels, and
    kernels 0.17's parser predates edition 6 ("unsupported build edition 6"), so it is
    not asked."""
    try:
        from kernels._rust import Build
    except ImportError:
        return False
    with _stderr_captured() as printed:
        try:
            Build.open(root)
        except ValueError as e:
            if f"unsupported build edition {EDITION}" in str(e):
                return False
            raise ConfigError(f"kernel-builder's parser (kernels._rust.Build) refuses build.toml: {e}") from e
    warning = "".join(printed).strip()
    if warning:
        raise ConfigError(f"kernel-builder's parser (kernels._rust.Build) warns about build.toml: {warning}")
    return True
