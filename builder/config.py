"""Reads and validates build.toml: the one source of truth for sources, backends and archs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import tomllib  # the builder needs Python >= 3.11; the built package supports 3.9+

SUPPORTED_BACKENDS = ("cuda", "cpu")
KNOWN_CAPABILITIES = ("7.5", "8.0", "8.6", "8.9", "9.0")
NAME_PATTERN = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")
COMPILED_SUFFIXES = (".cu", ".cpp", ".cc")


class ConfigError(Exception):
    """build.toml is missing something or holds a value the builder cannot use."""


@dataclass(frozen=True)
class KernelSection:
    name: str
    backend: str
    src: tuple[str, ...]
    include: tuple[str, ...]
    capabilities: tuple[str, ...]  # empty for cpu

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

    @property
    def python_name(self) -> str:
        return self.name.replace("-", "_")

    @property
    def package_dir(self) -> Path:
        return self.root / "torch-ext" / self.python_name

    def kernels_for(self, backend: str) -> tuple[KernelSection, ...]:
        return tuple(k for k in self.kernels if k.backend == backend)

    def capabilities(self) -> tuple[str, ...]:
        caps = {c for k in self.kernels_for("cuda") for c in k.capabilities}
        return tuple(sorted(caps, key=float))


def _require(table: dict, key: str, where: str, kind: type):
    if key not in table:
        raise ConfigError(f"build.toml: [{where}] lacks '{key}'")
    value = table[key]
    if not isinstance(value, kind):
        raise ConfigError(f"build.toml: [{where}] {key} must be a {kind.__name__}, got {value!r}")
    return value


def _string_list(table: dict, key: str, where: str, required: bool) -> tuple[str, ...]:
    if key not in table and not required:
        return ()
    values = _require(table, key, where, list)
    if not all(isinstance(v, str) for v in values):
        raise ConfigError(f"build.toml: [{where}] {key} must be a list of strings, got {values!r}")
    return tuple(values)


def _check_paths_exist(root: Path, paths: tuple[str, ...], where: str) -> None:
    for p in paths:
        if not (root / p).exists():
            raise ConfigError(f"build.toml: [{where}] names '{p}', which does not exist")


def load_config(root: Path) -> BuildConfig:
    path = root / "build.toml"
    if not path.is_file():
        raise ConfigError(f"no build.toml in {root}: run the builder from the repository root")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"build.toml does not parse: {e}") from e

    general = _require(raw, "general", "root", dict)
    name = _require(general, "name", "general", str)
    if not NAME_PATTERN.match(name):
        raise ConfigError(f"build.toml: [general] name must be lowercase and dash-separated, got {name!r}")
    version = _require(general, "version", "general", int)
    license_ = _require(general, "license", "general", str)
    backends = _string_list(general, "backends", "general", required=True)
    for b in backends:
        if b not in SUPPORTED_BACKENDS:
            raise ConfigError(f"build.toml: [general] backends has {b!r}; this builder knows {SUPPORTED_BACKENDS}")

    torch_table = _require(raw, "torch", "root", dict)
    torch_src = _string_list(torch_table, "src", "torch", required=True)
    _check_paths_exist(root, torch_src, "torch")

    kernel_tables = _require(raw, "kernel", "root", dict)
    kernels = []
    for kname, table in kernel_tables.items():
        where = f"kernel.{kname}"
        backend = _require(table, "backend", where, str)
        if backend not in backends:
            raise ConfigError(f"build.toml: [{where}] backend {backend!r} is not in [general] backends {list(backends)}")
        src = _string_list(table, "src", where, required=True)
        include = _string_list(table, "include", where, required=False)
        _check_paths_exist(root, src + include, where)
        caps = _string_list(table, "cuda-capabilities", where, required=False)
        if backend == "cuda" and not caps:
            raise ConfigError(f"build.toml: [{where}] needs cuda-capabilities (e.g. [\"7.5\", \"8.0\", \"9.0\"])")
        for c in caps:
            if c not in KNOWN_CAPABILITIES:
                raise ConfigError(f"build.toml: [{where}] cuda-capabilities has {c!r}; expected one of {KNOWN_CAPABILITIES}")
        if backend == "cpu" and any(s.endswith(".cu") for s in src):
            raise ConfigError(f"build.toml: [{where}] is a cpu kernel but lists .cu sources")
        kernels.append(KernelSection(kname, backend, src, include, caps))
    for b in backends:
        if not any(k.backend == b for k in kernels):
            raise ConfigError(f"build.toml: backend {b!r} is listed but no [kernel.*] section has backend = {b!r}")

    cfg = BuildConfig(root, name, version, license_, backends, torch_src, tuple(kernels))
    if not (cfg.package_dir / "__init__.py").is_file():
        raise ConfigError(f"no Python package at torch-ext/{cfg.python_name}/__init__.py")
    return cfg
