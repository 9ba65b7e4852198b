"""Timing the way the README's numbers are taken.

- kernel time: many calls captured in one CUDA graph and replayed, inputs rotated over
  enough copies that every call misses L2 (a cold-cache number), median of replays; every
  call keeps its own output buffers too, else the graph's allocator hands one buffer to
  all of them and L2 absorbs the writes; a graph holds at least MIN_GRAPH_BYTES of
  traffic so that its launch is a small share of a replay. A run that caps the copies
  (the sweep, the tuning harnesses) times a case too small to reach cold L2 within the cap
  L2-resident for every implementation instead (l2_resident);
- eager time: the calls issued from Python back to back over the same rotated inputs
  (launch and dispatch included, as a caller sees it), median over batches;
- host time: the host's time to issue a call whose work the GPU has not finished (launches
  queued, not waited for): what an eager forward pays per call when the host, not the GPU,
  bounds it;
- bandwidth: bytes a call must move (each input read once, each output written once)
  over kernel time, and that as a share of a device-to-device copy measured here;
- on the CPU only wall time: the implementations of a case in interleaved rounds, median
  (the smoke run: few rounds, to prove the script runs; the CPU sweep: many).
"""

import importlib.metadata
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

L2_MULTIPLE = 3  # rotated input copies span this many times the L2 size
MIN_GRAPH_BYTES = 1 << 30  # ~250 us of traffic at 4 TB/s: a graph launch is then < 2%


def l2_bytes() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size


def copies_for_cold_l2(input_bytes: int, cap: Optional[int] = None) -> int:
    """Input sets to rotate over so that a set is evicted from L2 before its next use. Where
    that takes more than `cap` sets (tiny inputs would want hundreds of thousands), the case
    runs L2-resident instead (see l2_resident): at most `cap` sets within half the L2."""
    copies = max(1, -(-L2_MULTIPLE * l2_bytes() // max(1, input_bytes)))
    if cap is None or copies <= cap:
        return copies
    return max(1, min(cap, l2_bytes() // 2 // max(1, input_bytes)))


def l2_resident(copies: int, input_bytes: int) -> bool:
    """Whether `copies` input sets of `input_bytes` fit in half the L2: a case too small for
    its capped rotation to reach cold L2 runs L2-resident for every implementation, its calls'
    outputs not held (the graph's allocator reuses their buffers). A rotation in between would
    leave a share of the inputs in L2 that shrinks with an implementation's own outputs, and
    so favour a peer that writes into its inputs (Liger's RoPE) over one with new outputs."""
    return copies * input_bytes <= l2_bytes() // 2


def calls_per_graph(copies: int, bytes_per_call: int, cap: Optional[int] = None) -> int:
    """Calls a graph holds: every input set once, and MIN_GRAPH_BYTES of traffic (at most
    `cap` calls, never fewer than the sets)."""
    calls = max(copies, -(-MIN_GRAPH_BYTES // max(1, bytes_per_call)))
    return calls if cap is None else max(copies, min(calls, cap))


def graph_time_us(calls: Sequence[Callable[[], object]], replays: int = 25, hold_outputs: bool = True) -> float:
    """Median time of one call, from replays of a graph holding every call once (each with
    its own outputs, unless hold_outputs is False: an L2-resident case's)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm up: lazy init and autotuning stay out of the graph
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = []
        for call in calls:
            out = call()
            if hold_outputs:
                outputs.append(out)  # held: each call writes its own buffers
    graph.replay()
    torch.cuda.synchronize()
    times: List[float] = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del outputs, graph
    return statistics.median(times)


def eager_time_us(calls: Sequence[Callable[[], object]], batch: int = 200, batches: int = 7) -> float:
    """Median time of one call issued from Python, cycling through ``calls`` (one per
    rotated input set, so the eager number is cold-L2 too)."""
    for i in range(max(10, len(calls))):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(batches):
        start.record()
        for i in range(batch):
            calls[i % len(calls)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / batch)
    return statistics.median(times)


def host_time_us(call: Callable[[], object], calls: int = 20, runs: int = 5) -> float:
    """Median over runs of the host's time per call for ``calls`` calls issued back to back,
    the GPU (if any) left to catch up between runs (a few calls queue far below the launch
    queue's depth, so none waits for the GPU)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    call()
    sync()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) * 1e6 / calls)
        sync()
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written: the better of
    PyTorch's copy and an elementwise kernel, timed eagerly (a copy captured in a graph
    becomes a memcpy node, which runs slower than a kernel)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    best_us = min(eager_time_us([lambda: dst.copy_(src)], batch=5, batches=5),
                  eager_time_us([lambda: torch.mul(src, 1.0, out=dst)], batch=5, batches=5))
    return 2 * nbytes / best_us / 1e3


def same_size_copy_us(nbytes: int, max_copies: Optional[int] = None, max_calls: Optional[int] = None) -> float:
    """Kernel time of a copy that moves ``nbytes`` (half read, half written) under the same
    protocol as an op: graph replay, sources rotated past L2, each call its own output. It is
    the roofline at sizes where launch, ramp-up and tail are a visible share of the time,
    which the rate of a 4 GB copy hides. max_copies and max_calls cap the sources and the
    calls a graph holds, as the op's own run caps them."""
    elements = max(1, nbytes // 2 // 2)  # 16-bit elements read (and as many written)
    sources = [torch.randn(elements, device="cuda").to(torch.bfloat16)
               for _ in range(copies_for_cold_l2(2 * elements, max_copies))]
    calls = calls_per_graph(len(sources), nbytes, max_calls)
    # mul by one is PyTorch's vectorized elementwise kernel; a copy_ in a graph becomes a
    # memcpy node, which runs slower (see copy_bandwidth_gbs)
    return graph_time_us([lambda s=sources[i % len(sources)]: torch.mul(s, 1) for i in range(calls)],
                         hold_outputs=not l2_resident(len(sources), 2 * elements))


def cpu_times_us(calls: Dict[str, Callable[[], object]], rounds: int = 5, min_batch_us: float = 0.0) -> Dict[str, float]:
    """Median wall time of one call of each callable on the CPU, over interleaved rounds: a
    round times every callable once, in an order that rotates from round to round, so that
    a load that comes and goes on a shared machine weighs on each alike. A callable faster
    than min_batch_us runs that many times in a row within a round (its batch; the round's
    time is the batch's mean), so that timer resolution and call jitter stay small."""
    batch = {}
    for name, call in calls.items():
        call()  # warm-up: first-call allocations and lazy initialisation stay out
        start = time.perf_counter()
        call()
        once_us = (time.perf_counter() - start) * 1e6
        batch[name] = max(1, int(min_batch_us / max(once_us, 1e-3)))
    names = list(calls)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds if names else 0):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            for _ in range(batch[name]):
                calls[name]()
            times[name].append((time.perf_counter() - start) * 1e6 / batch[name])
    return {name: statistics.median(t) for name, t in times.items()}


def cpu_time_us(call: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of one call on the CPU (smoke runs: no graphs, no events)."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def cpu_copy_bandwidth_gbs(nbytes: int = 64 << 20) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / cpu_time_us(lambda: dst.copy_(src)) / 1e3


def others_cpu_s() -> Optional[float]:
    """CPU seconds that other processes have used since boot: the machine's busy time in
    /proc/stat less this process's own (Linux; None where there is no /proc/stat)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    own = os.times()
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK") - own.user - own.system


class OthersLoad:
    """The share of the machine's CPU time that other processes take from now until share():
    0 on an otherwise idle machine, 1 when they keep every core busy. On a shared machine
    a multi-threaded CPU timing is worth little above a small share: a thread of a parallel
    region that waits for a core costs a scheduler slice, milliseconds."""

    def __init__(self):
        self.start_s, self.start = others_cpu_s(), time.perf_counter()

    def share(self) -> Optional[float]:
        end_s = others_cpu_s()
        if end_s is None or self.start_s is None:
            return None
        wall = max(time.perf_counter() - self.start, 1e-6)
        return max(0.0, (end_s - self.start_s) / (wall * (os.cpu_count() or 1)))


def wait_for_quiet(max_share: float, max_wait_s: float, window_s: float = 1.0) -> Optional[float]:
    """Waits until other processes take at most max_share of the CPU over a window, or
    max_wait_s has passed; returns the last window's share (None without /proc/stat)."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        load = OthersLoad()
        time.sleep(window_s)
        share = load.share()
        if share is None or share <= max_share or time.perf_counter() >= deadline:
            return share


def time_and_print(impls, sets, nbytes, bandwidth, reps, skipped, peer, notes=None, width=10, max_calls=None):
    """Times each (name, factory) of `impls` not in `skipped` (name -> why) by graph replay,
    calls rotated over the input `sets`, `reps` rounds in alternating order (drift between
    rounds falls on every candidate alike), then prints a row each: the rounds' times, the
    best, its % of the copy bandwidth, the best over `peer`'s, and notes[name]. max_calls caps
    a graph's calls (decode rows would otherwise want hundreds of thousands)."""
    notes = notes or {}
    calls_n = calls_per_graph(len(sets), nbytes, max_calls)
    hold = not l2_resident(len(sets), sum(t.numel() * t.element_size() for t in sets[0] if torch.is_tensor(t)))
    times = {}
    for rep in range(reps):
        for name, factory in impls if rep % 2 == 0 else impls[::-1]:
            if name not in skipped:
                calls = [factory(sets[i % len(sets)]) for i in range(calls_n)]
                times.setdefault(name, []).append(graph_time_us(calls, hold_outputs=hold))
    best_peer = min(times[peer]) if peer in times else None
    for name, _ in impls:
        if name in skipped:
            print(f"  {name:{width}s} {skipped[name]}")
            continue
        best = min(times[name])
        versus = f"  {best / best_peer:.3f} of {peer}" if best_peer else ""
        print(f"  {name:{width}s} {' '.join(f'{t:8.2f}' for t in times[name])}  best {best:8.2f} us "
              f"{nbytes / best / 1e3 / bandwidth * 100:5.1f}%{versus}{notes.get(name, '')}")


def library_versions(dists: Sequence[str] = ("liger-kernel", "quack-kernels", "triton", "kernels")) -> Dict[str, str]:
    """torch's version and those of the installed distributions among ``dists`` (the peers a
    run timed; one not installed is left out)."""
    versions = {"torch": torch.__version__}
    for dist in dists:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions
