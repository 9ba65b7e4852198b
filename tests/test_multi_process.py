"""The multi-GPU engines, with 2 processes on gloo (CPU): LTX-Video under diffusers' context
parallelism (Ulysses and ring), Llama and Qwen3 under transformers' tensor parallelism
(tp_plan="auto"), torch's sequence parallelism, transformers' own parallel styles and FSDP2,
each stock and kernelized in each order the engine allows, every output and gradient against
the single-process run; and every op on DTensors, through the sharding rules the package
registers.

The ranks run tests/multi_process_worker.py (started as torchrun starts them: RANK,
WORLD_SIZE, MASTER_ADDR/PORT) once for the module; each test reads what they recorded.
Each engine's case runs the stock model too: a stock failure is the host's (or this
machine's), not ltx-kernels'.
"""

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import REPO, TARGETS, _build_folder_held, load_variant

pytest.importorskip("transformers", reason="requirements-dev.txt installs transformers")
pytest.importorskip("diffusers", reason="requirements-dev.txt installs diffusers")
pytest.importorskip("accelerate", reason="transformers' tp_plan needs accelerate (requirements-dev.txt)")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no gloo backend", allow_module_level=True)

from multi_process_worker import PROGRESS, op_cases  # noqa: E402

WORLD_SIZE = 2
WORKER = Path(__file__).with_name("multi_process_worker.py")
TIMEOUT_S = 900

CONTEXT_PARALLEL = ["kernelized before", "kernelized after", "kernelized before, unkernelized after",
                    "kernelized and unkernelized after"]
# case -> (its stock variant(s), the kernelized variants)
ENGINES = {
    "ltx context parallel": {f"{a}: {v}": f"{a}: stock" for a in ("ulysses", "ring") for v in CONTEXT_PARALLEL},
    "qwen3 tp_plan=auto": {v: "stock" for v in ("kernelized", "kernelized and unkernelized")},
    "llama tp_plan=auto": {v: "stock" for v in ("kernelized", "kernelized and unkernelized")},
    "qwen3 tp_plan with sequence_parallel norms": {v: "stock" for v in ("kernelized", "kernelized and unkernelized")},
    "qwen3 sequence parallel": {v: "stock" for v in ("kernelized before", "kernelized after")},
    "llama sequence parallel": {v: "stock" for v in ("kernelized before", "kernelized after")},
    "transformers parallel style": {v: "stock" for v in ("kernelized before", "kernelized after",
                                                          "kernelized and unkernelized after")},
    "qwen3 fsdp2": {v: "stock" for v in ("kernelized before", "kernelized after")},
    "llama fsdp2": {v: "stock" for v in ("kernelized before", "kernelized after")},
}

lki = load_variant(next(backend for backend, device in TARGETS if device == "cpu"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(out: Path) -> list:
    """Start WORLD_SIZE workers writing to ``out``; what each returned and its log."""
    out.mkdir(parents=True)
    # CPU ranks on any machine: with a GPU visible, diffusers and transformers would build
    # their device meshes on it.
    env = dict(os.environ, WORLD_SIZE=str(WORLD_SIZE), LOCAL_WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), str(WORKER.parent), os.environ.get("PYTHONPATH", "")]))
    logs = [out / f"rank{rank}.log" for rank in range(WORLD_SIZE)]
    with _build_folder_held(exclusive=False):
        procs = [subprocess.Popen([sys.executable, str(WORKER), str(out)], cwd=REPO,
                                  env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                  stdout=open(log, "w"), stderr=subprocess.STDOUT)
                 for rank, log in enumerate(logs)]
        try:
            for proc in procs:
                proc.wait(timeout=TIMEOUT_S)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return [(proc.returncode, log) for proc, log in zip(procs, logs)]


def _where(log: Path) -> str:
    """The last progress line of a rank's log: the case it was in, or that it had finished."""
    lines = [line for line in log.read_text().splitlines() if line.startswith(PROGRESS)]
    return lines[-1] if lines else "before its first case"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each rank recorded: [rank 0's {case: {variant: ...}}, rank 1's].

    A rank killed by a signal (an abort of glibc's heap checks or a segfault, in any library
    of the process: a crash, not a wrong result) gets the whole run once more; its log, with
    each thread's Python stack, is kept as a warning. A second death fails the tests.
    """
    out = tmp_path_factory.mktemp("ranks")
    ran = _run_ranks(out / "run")
    crashed = [(rank, code, log) for rank, (code, log) in enumerate(ran) if code is not None and code < 0]
    if crashed:
        for rank, code, log in crashed:
            warnings.warn(f"rank {rank} died of signal {-code} ({_where(log)}); the ranks ran again:\n"
                          f"{log.read_text()[-6000:]}")
        ran = _run_ranks(out / "rerun")
    results = []
    for rank, (code, log) in enumerate(ran):
        path = log.with_name(f"rank{rank}.json")
        if not path.exists() or code != 0:
            pytest.fail(f"rank {rank} exited with {code} ({_where(log)}):\n{log.read_text()[-6000:]}")
        results.append(json.loads(path.read_text()))
    return results


def _outcome(ranks, case, variant) -> list:
    """What went wrong in ``variant`` of ``case``, on any rank."""
    problems = []
    for rank, recorded in enumerate(ranks):
        variants = recorded.get(case, {})
        if "setup" in variants:
            problems.append(f"rank {rank}: the case failed before its variants:\n{variants['setup']['error']}")
        elif variant not in variants:
            problems.append(f"rank {rank}: not run")
        elif variants[variant]["error"]:
            problems.append(f"rank {rank}: {variants[variant]['error']}")
        else:
            problems += [f"rank {rank}: {d}" for d in variants[variant]["differences"]]
    return problems


@pytest.mark.parametrize("case,variant", [(c, v) for c, vs in ENGINES.items() for v in vs],
                         ids=[f"{c}: {v}" for c, vs in ENGINES.items() for v in vs])
def test_engine_matches_single_process(ranks, case, variant):
    stock = _outcome(ranks, case, ENGINES[case][variant])
    assert not stock, f"the stock model fails under {case} (the host or this machine, not ltx-kernels):\n" + \
        "\n".join(stock)
    ours = _outcome(ranks, case, variant)
    assert not ours, f"{case}, {variant}:\n" + "\n".join(ours)


def _namespace_ops() -> list:
    prefix = lki.ops.name + "::"
    return sorted(name[len(prefix):] for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix))


def test_every_op_has_a_sharding_rule():
    """Every op of the build's namespace has a DTensor rule registered by the package and a
    case in the worker that runs it on DTensors."""
    import torch.distributed.tensor  # noqa: F401  (the package registers its rules on this import at the latest)
    from torch.distributed.tensor import DTensor

    names = _namespace_ops()
    assert len(names) >= 31
    strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    assert [n for n in names if getattr(lki.ops, n).default not in strategies] == []
    assert sorted(set(names) - set(lki.sharding.RULES)) == []
    assert sorted(set(names) - {case[0] for case in op_cases(lki)}) == []


@pytest.mark.parametrize("op", sorted({case[0] for case in op_cases(lki)}))
def test_op_on_dtensors(ranks, op):
    """The op on DTensors split on each leading dim (and the pointwise ones on the last):
    the single-process result, the expected placements (grads of what broadcasts over the
    split come back Partial), no collective in the call."""
    variants = sorted({v for recorded in ranks for v in recorded.get("ops", {}) if v.startswith(op + " [")})
    assert variants, f"{op}: no case ran"
    problems = [f"{v}: {p}" for v in variants for p in _outcome(ranks, "ops", v)]
    assert not problems, "\n".join(problems)


def test_rules_registered_when_dtensor_is_imported_later():
    """A process that imports the package before torch.distributed.tensor gets the rules
    at that import, and has not paid for it before."""
    code = ("import sys, torch\n"
            "sys.path[:0] = [{tests!r}]\n"
            "from conftest import load_variant\n"
            "lki = load_variant({backend!r})\n"
            "assert 'torch.distributed.tensor' not in sys.modules\n"
            "assert not lki.sharding._registered\n"
            "from torch.distributed.tensor import DTensor\n"
            "strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
            "assert lki.ops.rms_norm.default in strategies and lki.ops.rope_.default in strategies\n"
            ).format(tests=str(WORKER.parent), backend=next(b for b, d in TARGETS if d == "cpu"))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=300)


def test_multi_gpu_benchmark_runs_on_cpu_ranks(tmp_path):
    """benchmarks/e2e/multi_gpu.py --tiny on 2 gloo ranks: the rows of the GPU run (LTX-Video on
    one GPU, Ulysses, ring; Qwen3 prefill and decode on one GPU and under tp_plan="auto";
    stock and kernelized), every output within rounding of the one-rank run of the same code
    and the kernelized rows counting replaced modules."""
    out = tmp_path / "multi_gpu.json"
    env = dict(os.environ, WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "benchmarks.e2e.multi_gpu", "--tiny", "--device", "cpu", "--warmup", "0",
               "--repeats", "1", "--checkpoint-dir", str(tmp_path), "--json", str(out)]
    with _build_folder_held(exclusive=False):
        procs = [subprocess.Popen(command, cwd=REPO, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(WORLD_SIZE)]
        logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    rows = json.loads(out.read_text())["rows"]
    ltx = [(s, c) for s in ("1 GPU", "ulysses", "ring") for c in ("stock", "kernelized")]
    qwen3 = [(w, s, c) for s in ("1 GPU", "tensor parallel") for c in ("stock", "kernelized")
             for w in ("qwen3 prefill", "qwen3 decode")]
    qwen3 += [("qwen3 training step", s, c) for s in ("1 GPU", "tensor parallel", "FSDP2")
              for c in ("stock", "kernelized")]
    assert [(r["setup"], r["config"]) for r in rows if r["model"] == "tiny"] == ltx
    assert [(r["model"], r["setup"], r["config"]) for r in rows if r["model"] != "tiny"] == qwen3
    for r in rows:
        assert r["error"] is None and r["ms"] > 0, r
        assert bool(r["replaced"]) == (r["config"] == "kernelized"), r
        if r["setup"] != "1 GPU":  # bf16: the parallel code's other order of sums
            assert r["rel_l2"] < (5e-2 if r["model"] == "qwen3 training step" else 1e-2), r
    assert "| tiny | ulysses |" in out.with_suffix(".md").read_text()
