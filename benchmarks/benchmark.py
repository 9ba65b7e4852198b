"""Workloads for `kernels benchmark`, one Benchmark class per op family. Self-contained
as uploaded: it needs only torch, kernels and the kernel it is given (whose `reference`
module holds the host libraries' code it verifies against).

    kernels benchmark ./                          # repo root, on a GPU; loads build/
    kernels benchmark ltx-kernels/ltx-kernels --version 1
    python benchmarks/benchmark.py --self-check [KERNEL_DIR]   # each workload once on the CPU

The CLI loads this file, makes one instance per ``benchmark_<w>`` method, sets
``self.kernel`` (the loaded ltx_kernels) and ``self.device``, runs ``setup_<w>``, calls
the workload once, and compares ``self.out`` with what ``verify_<w>`` returns using
``torch.allclose(atol=1e-2)``; then it times the workload. Hence: fp16 (bf16 norms miss
that tolerance by a rounding step; bf16 correctness is pytest's job), inputs scaled so
outputs stay below 16 (one fp16 step there is < 1e-2), and out-variants so the timed call
allocates nothing. References: the host library's code where the op reproduces its
roundings (Llama RMSNorm, LTX RoPE and prologue, GEGLU, GELU); that code on fp32 copies,
rounded once, where the op rounds once and the library more often (AdaLN, the gated
residual, transformers' RoPE), which keeps every difference within one fp16 step. The
in-place RoPE workloads verify against copies taken in setup: the CLI calls the workload
exactly once before verifying. Shapes are the model shapes of benchmarks/bench_ops.py on
a GPU and small ones on the CPU (the self-check).
"""

import sys
from pathlib import Path

import torch
from kernels.benchmark import Benchmark

REPO = Path(__file__).resolve().parents[1]
FP16 = torch.float16


def sized(device: str, gpu_shape: tuple, cpu_shape: tuple) -> tuple:
    return cpu_shape if device == "cpu" else gpu_shape


def randn(*shape, device: str, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=FP16) * scale


def ref(bench: Benchmark):
    """The host libraries' code, from the kernel under test (its `reference` module)."""
    return bench.kernel.reference


def rounded_once(fn, *tensors):
    """``fn`` on fp32 copies, its outputs rounded to fp16 once."""
    outputs = fn(*(t.float() for t in tensors))
    return tuple(o.to(FP16) for o in outputs) if isinstance(outputs, tuple) else outputs.to(FP16)


class RMSNormBenchmark(Benchmark):
    seed = 0

    def setup_llama(self):
        """transformers' Llama order (normed value rounded before the weight)."""
        rows, d = sized(self.device, (8192, 4096), (64, 512))
        self.x = randn(rows, d, device=self.device)
        self.weight = 1 + randn(d, device=self.device, scale=0.1)
        self.out = torch.empty_like(self.x)

    def benchmark_llama(self):
        self.kernel.rms_norm(self.x, self.weight, 1e-6, cast_before_weight=True, out=self.out)

    def verify_llama(self):
        return ref(self).llama_rms_norm(self.x, self.weight)

    def setup_ltx_no_weight(self):
        """LTX-Video's norm1/norm2: diffusers RMSNorm without weight."""
        rows, d = sized(self.device, (5376, 2048), (48, 256))
        self.x = randn(rows, d, device=self.device)
        self.out = torch.empty_like(self.x)

    def benchmark_ltx_no_weight(self):
        self.kernel.rms_norm(self.x, None, 1e-6, out=self.out)

    def verify_ltx_no_weight(self):
        return ref(self).diffusers_rms_norm(self.x)


class AdaLNBenchmark(Benchmark):
    """LTX-Video's block at [2, 2688, 2048] with one scale/shift per sample."""

    seed = 0

    def make_inputs(self):
        b, s, d = sized(self.device, (2, 2688, 2048), (2, 24, 256))
        self.x = randn(b, s, d, device=self.device)
        self.scale, self.shift, self.gate = (randn(b, 1, d, device=self.device, scale=0.1) for _ in range(3))
        self.out = torch.empty_like(self.x)

    def setup_rms(self):
        self.make_inputs()

    def benchmark_rms(self):
        self.kernel.adaln(self.x, self.scale, self.shift, 1e-6, norm="rms", out=self.out)

    def verify_rms(self):
        return rounded_once(ref(self).adaln("rms"), self.x, self.scale, self.shift)

    def setup_layer(self):
        self.make_inputs()

    def benchmark_layer(self):
        self.kernel.adaln(self.x, self.scale, self.shift, 1e-6, norm="layer", out=self.out)

    def verify_layer(self):
        return rounded_once(ref(self).adaln("layer"), self.x, self.scale, self.shift)

    def setup_gated_residual_rms(self):
        """``h = residual + attn * gate`` and the next norm's modulate, one pass; self.out
        holds (h, modulated)."""
        self.make_inputs()
        self.residual = randn(*self.x.shape, device=self.device)
        self.out = torch.empty(2, *self.x.shape, device=self.device, dtype=FP16)

    def benchmark_gated_residual_rms(self):
        self.kernel.gated_residual_adaln(self.residual, self.x, self.gate, self.scale, self.shift, 1e-6, norm="rms",
                                         residual_out=self.out[0], out=self.out[1])

    def verify_gated_residual_rms(self):
        return torch.stack(rounded_once(ref(self).gated_residual_adaln("rms"), self.residual, self.x, self.gate,
                                        self.scale, self.shift))


class RoPEBenchmark(Benchmark):
    seed = 0

    def setup_rotate_half(self):
        """transformers' layout: q [1, 32, 8192, 128] and k [1, 8, 8192, 128] as transposed
        views of one [B, S, Hq + Hkv, D] buffer (self.out), rotated in place."""
        b, hq, hkv, s, d = sized(self.device, (1, 32, 8, 8192, 128), (1, 4, 2, 16, 64))
        self.heads_q = hq
        self.out = randn(b, s, hq + hkv, d, device=self.device)
        self.original = self.out.clone()
        angle = torch.rand(b, s, d // 2, device=self.device)
        table = torch.cat([angle, angle], -1)
        self.cos, self.sin = table.cos().to(FP16), table.sin().to(FP16)

    def split_heads(self, buffer):
        return buffer[:, :, :self.heads_q].transpose(1, 2), buffer[:, :, self.heads_q:].transpose(1, 2)

    def benchmark_rotate_half(self):
        q, k = self.split_heads(self.out)
        self.kernel.rope_rotate_half(q, k, self.cos, self.sin, inplace=True)

    def verify_rotate_half(self):
        q, k = rounded_once(ref(self).transformers_rope, *self.split_heads(self.original), self.cos, self.sin)
        expected = torch.empty_like(self.original)
        for view, value in zip(self.split_heads(expected), (q, k)):
            view.copy_(value)
        return expected

    def make_ltx_inputs(self):
        b, s, c = sized(self.device, (2, 2688, 2048), (2, 24, 256))
        self.out = randn(2, b, s, c, device=self.device)  # q, k
        angle = torch.rand(b, s, c // 2, device=self.device).repeat_interleave(2, -1)
        self.cos, self.sin = angle.cos(), angle.sin()  # fp32, as LTX-Video makes them

    def setup_ltx_interleaved(self):
        """LTX-Video: q/k [2, 2688, 2048] rotated in place with fp32 [B, S, C] tables."""
        self.make_ltx_inputs()
        self.original = self.out.clone()

    def benchmark_ltx_interleaved(self):
        self.kernel.rope_interleaved(self.out[0], self.out[1], self.cos, self.sin, inplace=True)

    def verify_ltx_interleaved(self):
        return torch.stack(ref(self).ltx_rope(self.original[0], self.original[1], self.cos, self.sin))

    def setup_ltx_qk_norm_rope(self):
        """LTX-Video's attention prologue (qk RMSNorm across heads, then RoPE) into self.out."""
        self.make_ltx_inputs()
        self.q, self.k = self.out.clone().unbind(0)
        c = self.q.shape[-1]
        self.q_weight, self.k_weight = (1 + randn(c, device=self.device, scale=0.1) for _ in range(2))

    def benchmark_ltx_qk_norm_rope(self):
        self.kernel.qk_norm_rope(self.q, self.k, self.q_weight, self.k_weight, self.cos, self.sin, 1e-5,
                                 out=(self.out[0], self.out[1]))

    def verify_ltx_qk_norm_rope(self):
        return torch.stack(ref(self).ltx_qk_norm_rope(self.q, self.k, self.q_weight, self.k_weight, self.cos, self.sin))


class ActivationBenchmark(Benchmark):
    seed = 0

    def setup_geglu(self):
        """diffusers' GEGLU on [8192, 2 x 5120] (inputs halved: value * gelu(gate) < 8)."""
        rows, h = sized(self.device, (8192, 5120), (64, 256))
        self.x = randn(rows, 2 * h, device=self.device, scale=0.5)
        self.out = torch.empty(rows, h, device=self.device, dtype=FP16)

    def benchmark_geglu(self):
        self.kernel.geglu(self.x, "none", out=self.out)

    def verify_geglu(self):
        return ref(self).diffusers_geglu(self.x)

    def setup_gelu_tanh(self):
        """LTX-Video's feed-forward activation on [2, 2688, 8192]."""
        self.x = randn(*sized(self.device, (2, 2688, 8192), (2, 24, 512)), device=self.device)
        self.out = torch.empty_like(self.x)

    def benchmark_gelu_tanh(self):
        self.kernel.gelu(self.x, "tanh", out=self.out)

    def verify_gelu_tanh(self):
        return ref(self).gelu_tanh(self.x)


def self_check(kernel_dir: Path) -> int:
    """Runs this file through the CLI's own discovery and runner (kernels 0.19), on the
    CPU whatever the machine has, one timed iteration each, on the build in ``kernel_dir``
    (a checkout with build/). Returns the failure count."""
    from unittest import mock

    from kernels._internals.backends import CPU
    from kernels._internals.cli import benchmark as cli

    failures = passes = 0
    # The runner picks the device from torch's build (CUDA here even without a GPU).
    with mock.patch.object(cli, "_backend", CPU):
        for cls in cli.discover_benchmark_classes(Path(__file__).resolve(), kernel_dir):
            try:
                results, _ = cli.run_benchmark_class(cls, iterations=1, warmup=1, repo_id=str(kernel_dir),
                                                     is_local=True, revision="local")
            except Exception as e:  # the runner stops a class at its first failed verification
                failures += 1
                print(f"FAILED {cls.__name__}: {type(e).__name__}: {e}")
                continue
            for workload, timing in sorted(results.items()):
                ok = timing.verified is True
                passes += ok
                failures += not ok
                print(f"{'ok' if ok else 'NOT VERIFIED'} {cls.__name__}.{workload}")
    print(f"{passes} passed, {failures} failed")
    return failures


if __name__ == "__main__":
    if sys.argv[1:2] != ["--self-check"] or len(sys.argv) > 3:
        sys.exit(__doc__)
    sys.exit(1 if self_check(Path(sys.argv[2]).resolve() if len(sys.argv) == 3 else REPO) else 0)
