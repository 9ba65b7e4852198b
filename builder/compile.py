"""Compiles sources in parallel, skipping objects whose command and inputs are unchanged,
and reads ptxas's resource report so that a kernel that spills fails the build."""

from __future__ import annotations

import hashlib
import re
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


class CompileError(Exception):
    pass


@dataclass
class Job:
    label: str  # what progress lines show, e.g. "kernel_src/rms_norm.cu sm_75 sm_80 sm_90+PTX"
    source: Path
    obj: Path
    cmd: list[str]

    @property
    def depfile(self) -> Path:
        return self.obj.with_suffix(".d")

    @property
    def stampfile(self) -> Path:
        return self.obj.with_suffix(".stamp")

    @property
    def reportfile(self) -> Path:
        return self.obj.with_suffix(".ptxas")


@dataclass
class KernelResources:
    arch: str
    kernel: str
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclass
class JobResult:
    job: Job
    cached: bool
    seconds: float
    resources: list[KernelResources] = field(default_factory=list)


def _depfile_inputs(depfile: Path) -> list[Path]:
    """Inputs a previous compile read, from its make-style depfile."""
    if not depfile.is_file():
        return []
    text = depfile.read_text().replace("\\\n", " ")
    _, _, deps = text.partition(":")
    return [Path(p) for p in shlex.split(deps.replace("\\ ", "\0")) if p]


def _stamp(job: Job) -> str | None:
    """Hash of the command, every input of the last compile and the object it made (so a
    damaged object is rebuilt too); None forces a compile."""
    inputs = _depfile_inputs(job.depfile)
    if not inputs or not job.obj.is_file():
        return None
    h = hashlib.sha256("\0".join(job.cmd).encode())
    h.update(job.obj.read_bytes())
    for p in sorted(set(inputs)):
        if not p.is_file():
            return None
        h.update(str(p).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(log: str) -> list[KernelResources]:
    """Per-kernel registers and spills from `-Xptxas -v` output."""
    out: list[KernelResources] = []
    current: dict | None = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = {"kernel": m.group(1), "arch": m.group(2), "stack": 0, "st": 0, "ld": 0}
        elif current is not None and (m := _FRAME.search(line)):
            current.update(stack=int(m.group(1)), st=int(m.group(2)), ld=int(m.group(3)))
        elif current is not None and (m := _REGS.search(line)):
            out.append(KernelResources(current["arch"], current["kernel"], int(m.group(1)),
                                       current["stack"], current["st"], current["ld"]))
            current = None
    names = _demangle([r.kernel for r in out])
    for r, name in zip(out, names):
        r.kernel = name
    return out


def _demangle(names: list[str]) -> list[str]:
    if not names:
        return names
    try:
        res = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
        demangled = res.stdout.splitlines()
        return demangled if len(demangled) == len(names) else names
    except FileNotFoundError:
        return names


def _run_one(job: Job) -> JobResult:
    stamp = _stamp(job)
    if stamp is not None and job.stampfile.is_file() and job.stampfile.read_text() == stamp:
        report = job.reportfile.read_text() if job.reportfile.is_file() else ""
        return JobResult(job, cached=True, seconds=0.0, resources=parse_ptxas(report))
    job.obj.parent.mkdir(parents=True, exist_ok=True)
    # The stamp's own write time, in the file system's clock (coarser than time.time()).
    job.stampfile.write_text("")
    started = job.stampfile.stat().st_mtime_ns
    start = time.monotonic()
    proc = subprocess.run(job.cmd, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise CompileError(
            f"compiling {job.label} failed (exit {proc.returncode}):\n"
            f"{shlex.join(job.cmd)}\n{proc.stdout}{proc.stderr}"
        )
    job.reportfile.write_text(proc.stderr)
    finished = job.reportfile.stat().st_mtime_ns
    # An input edited while it compiled may not be in the object: no stamp, so the next
    # build compiles it again. Edited: written after the stamp's write (a source written
    # in that clock tick, just before the build, is not taken for one) and not after the
    # report's (a time in the future, from a copy off a clock ahead, is not either).
    edited = any(p.is_file() and started < p.stat().st_mtime_ns <= finished for p in _depfile_inputs(job.depfile))
    new_stamp = None if edited else _stamp(job)
    if new_stamp is not None:
        job.stampfile.write_text(new_stamp)
    return JobResult(job, cached=False, seconds=seconds, resources=parse_ptxas(proc.stderr))


def run_jobs(jobs: list[Job], workers: int, prefix: str, register_log: Path | None = None,
             verbose: bool = False) -> list[JobResult]:
    """Run jobs in parallel, printing one progress line per finished file. Each kernel's
    registers and spills per arch go to ``register_log`` (and to stdout with ``verbose``);
    a kernel that spills fails the build, named."""
    results: list[JobResult] = []
    width = len(str(len(jobs)))
    table: list[str] = []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(_run_one, j) for j in jobs]
        for i, fut in enumerate(futures, 1):
            res = fut.result()
            status = "up to date" if res.cached else f"{res.seconds:5.1f}s"
            print(f"[{prefix} {i:>{width}}/{len(jobs)}] {res.job.label}  {status}", flush=True)
            rows = [f"{r.arch:6s} regs {r.registers:3d}  stack {r.stack:4d}B  "
                    f"spill {r.spill_stores}/{r.spill_loads}B  {r.kernel}" for r in res.resources]
            table += [f"{res.job.label}"] + [f"      {row}" for row in rows]
            if verbose and rows:
                print("\n".join(f"      {row}" for row in rows), flush=True)
            results.append(res)
    if register_log is not None:
        register_log.parent.mkdir(parents=True, exist_ok=True)
        register_log.write_text("\n".join(table) + "\n")
    resources = [r for res in results for r in res.resources]
    spilling = [r for r in resources if r.spills]
    if spilling:
        lines = "\n".join(f"  {r.arch} {r.kernel}: {r.spill_stores} B stores, {r.spill_loads} B loads"
                          for r in spilling)
        raise CompileError(f"kernels spill registers to local memory (every kernel here is hot):\n{lines}")
    if resources:
        most: dict[str, int] = {}
        for r in resources:
            most[r.arch] = max(most.get(r.arch, 0), r.registers)
        archs = sorted(most, key=lambda a: int(a[3:].rstrip("a")))
        where = f"; per kernel: {register_log}" if register_log is not None and not verbose else ""
        print(f"[{prefix}] {len({r.kernel for r in resources})} kernels on {', '.join(archs)}, none spills; most "
              f"registers {max(most.values())}{where}", flush=True)
    return results


def link(objs: list[Path], out: Path, cmd_prefix: list[str], libs: list[str]) -> None:
    cmd = cmd_prefix + ["-shared", "-o", str(out)] + [str(o) for o in objs] + libs
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompileError(f"linking {out.name} failed:\n{shlex.join(cmd)}\n{proc.stdout}{proc.stderr}")
