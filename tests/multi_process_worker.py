"""One rank of the multi-process tests (tests/test_multi_process.py starts WORLD_SIZE of them, as
torchrun would: RANK, WORLD_SIZE, LOCAL_RANK in the environment, gloo on the CPU).

    python tests/multi_process_worker.py OUT_DIR [CASE ...]
    LTX_WORKER_DEVICE=cuda torchrun --nproc-per-node 2 tests/multi_process_worker.py OUT_DIR ops

With LTX_WORKER_DEVICE=cuda (a machine of two or more GPUs) the ranks use NCCL, one GPU
each, and the CUDA variant: the "ops" case then runs every op on CUDA DTensors.

Each case builds tiny models from their configs (no downloads), runs them on one process
and under a multi-GPU engine, stock and kernelized in each order, and records what differs
from the single-process run; the rank writes OUT_DIR/rank<r>.json. The kernel is loaded as
the rest of the suite loads it (conftest.load_variant: the build in build/, or LOCAL_KERNELS).

Test-only shims for a CPU machine (installed by `cpu_shims`): diffusers' enable_parallelism
divides the rank by the accelerator count, 0 without one; its ring attention needs an
attention backend that returns the log-sum-exp, which the native (SDPA) backend does not.
"""

import copy
import datetime
import faulthandler
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from test_integration_transformers import OpsCalled

SMALL_LLM = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
# Outputs: fp32 ours against stock differ by roundings; grads as tests/test_training.py.
OUTPUT_ATOL, GRAD_ATOL = 1e-5, 2e-4


DEVICE = os.environ.get("LTX_WORKER_DEVICE", "cpu")
# Lines of the rank's log that say how far it got (the test quotes them when a rank dies).
PROGRESS, RESULTS_WRITTEN = "[worker]", "results written"


def load_kernel():
    from conftest import TARGETS, load_variant

    if DEVICE == "cuda":
        return load_variant("cuda")
    return load_variant(next(backend for backend, device in TARGETS if device == "cpu"))


def cpu_shims():
    """The two shims the module docstring describes (test-only)."""
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1
    from diffusers.models import attention_dispatch

    def attention_with_lse(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                           enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        if _save_ctx:
            ctx.save_for_backward(query, key, value)
            ctx.attn_mask, ctx.dropout_p, ctx.is_causal, ctx.scale, ctx.enable_gqa = (
                attn_mask, dropout_p, is_causal, scale, enable_gqa)
        q, k, v = (t.permute(0, 2, 1, 3).float() for t in (query, key, value))  # [B, H, S, D]
        scores = q @ k.transpose(-1, -2) * (q.size(-1) ** -0.5 if scale is None else scale)
        if attn_mask is not None:
            scores = scores + attn_mask
        lse = scores.logsumexp(-1)
        out = ((scores - lse[..., None]).exp() @ v).permute(0, 2, 1, 3).to(query.dtype)
        return (out, lse.permute(0, 2, 1)) if return_lse else out

    attention_dispatch._native_attention_forward_op = attention_with_lse


# ---------------------------------------------------------------------------------------
# Comparisons: each returns a list of what differs (empty when everything matches).


def full(t):
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) and t.dtype == torch.float8_e4m3fn:
        t = t.float()  # gathered as fp32 values (gloo has no float8 collectives)
    return t.full_tensor() if isinstance(t, DTensor) else t


def differences(actual, expected, atol: float, name: str) -> list:
    actual, expected = full(actual).detach().float(), expected.detach().float()
    if actual.shape != expected.shape:
        return [f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"]
    scale = max(expected.abs().max().item(), 1e-6)
    error = (actual - expected).abs().max().item() if actual.numel() else 0.0
    return [] if error <= atol * scale else [f"{name}: max error {error:.3g} > {atol * scale:.3g}"]


def grad_differences(model, expected: dict, local_partials: bool = False) -> list:
    """Every parameter's grad against the single-process run's (``local_partials``: a
    Partial grad's local part, each rank's own sum, against it)."""
    from torch.distributed.tensor import DTensor, Partial

    found = []
    for name, p in model.named_parameters():
        name = name.replace("_orig_mod.", "")
        if p.grad is None:
            found.append(f"{name}: no grad")
            continue
        grad = p.grad
        if local_partials and isinstance(grad, DTensor) and any(isinstance(pl, Partial) for pl in grad.placements):
            grad = grad.to_local()
        found += differences(grad, expected[name], GRAD_ATOL, f"grad {name}")
    return found


def variant(record: dict, name: str, run) -> None:
    """``record[name]``: the differences ``run()`` returns, or the error it raised."""
    try:
        record[name] = {"differences": run(), "error": None}
    except Exception as error:  # recorded for the test to report, with where it came from
        record[name] = {"differences": [], "error": f"{type(error).__name__}: {error}\n"
                                                   f"{''.join(traceback.format_exc(limit=-6))}"}


# ---------------------------------------------------------------------------------------
# Every op on DTensors.


def op_cases(lki):
    """(op, split, args, placements, results): the op called with its tensors distributed
    with ``placements`` (None: not a tensor), ``results`` the indices of the args it writes
    (out= and in-place forms) or None for its return values, and the placements of the
    results it must return (None: not checked)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    B, S, D = 4, 6, 8
    R = Replicate()
    cases = []
    for dim in (0, 1):
        row = Shard(dim)
        x, res, go, extra = rand(B, S, D), rand(B, S, D), rand(B, S, D), rand(B, S, D)
        w = rand(D)
        scale, shift, gate = rand(B, 1, D), rand(B, S, D), rand(D)
        mod = (row if dim == 0 else R), row, R  # placements of scale [B,1,D], shift [B,S,D], gate [D]
        grads = (row if dim == 0 else Partial()), row, Partial()
        rms = [1e-6, 0.0, True]
        cases += [
            ("rms_norm", dim, [x, w, *rms, None], [row, R, None, None, None, None], None, [row]),
            ("rms_norm", f"{dim}, no weight", [x, None, *rms, None], [row, None, None, None, None, None], None,
             [row]),
            ("rms_norm_out", dim, [torch.empty_like(x), x, w, *rms], [row, row, R, None, None, None], [0], None),
            ("fused_add_rms_norm", dim, [x, res, w, *rms], [row, row, R, None, None, None], None, [row, row]),
            ("fused_add_rms_norm_out", dim, [torch.empty_like(x), torch.empty_like(x), x, res, w, *rms],
             [row, row, row, row, R, None, None, None], [0, 1], None),
            ("rms_norm_backward", dim, [go, x, w, *rms, extra], [row, row, R, None, None, None, row], None,
             [row, Partial()]),
            ("quantize_fp8", dim, [x], [row], None, [row, row]),
            ("quantize_fp8_static", dim, [x, torch.tensor([0.05])], [row, R], None, [row]),
            ("rms_norm_fp8", dim, [x, w, *rms], [row, R, None, None, None], None, [row, row]),
            ("rms_norm_fp8_static", dim, [x, None, 1e-6, 0.0, False, torch.tensor([0.05])],
             [row, None, None, None, None, R], None, [row]),
            ("adaln", dim, [x, scale, shift, 1e-6, "rms"], [row, *mod[:2], None, None], None, [row]),
            ("adaln_fp8", dim, [x, scale, shift, 1e-6, "rms"], [row, *mod[:2], None, None], None, [row, row]),
            ("adaln_fp8_static", dim, [x, scale, shift, 1e-6, "layer", torch.tensor([0.05])],
             [row, *mod[:2], None, None, R], None, [row]),
            ("adaln_out", dim, [torch.empty_like(x), x, scale, shift, 1e-6, "layer"],
             [row, row, *mod[:2], None, None], [0], None),
            ("adaln_with_stats", dim, [x, scale, shift, 1e-6, "layer"], [row, *mod[:2], None, None], None,
             [row, row]),
            ("adaln_backward", dim, [go, x, scale, shift, 1e-6, "layer", extra,
                                     lki.ops.adaln_with_stats(x, scale, shift, 1e-6, "layer")[1]],
             [row, row, *mod[:2], None, None, row, row], None, [row, *grads[:2]]),
            ("gated_residual_adaln", dim, [res, x, gate, scale, shift, 1e-6, "rms"],
             [row, row, mod[2], *mod[:2], None, None], None, [row, row]),
            ("gated_residual_adaln_fp8", dim, [res, x, gate, scale, shift, 1e-6, "rms"],
             [row, row, mod[2], *mod[:2], None, None], None, [row, row, row]),
            ("gated_residual_adaln_fp8_static", dim, [res, x, gate, scale, shift, 1e-6, "layer", torch.tensor([0.05])],
             [row, row, mod[2], *mod[:2], None, None, R], None, [row, row]),
            ("gelu_fp8", dim, [x, "tanh"], [row, None], None, [row, row]),
            ("gelu_fp8_static", dim, [x, "none", torch.tensor([0.05])], [row, None, R], None, [row]),
            ("gelu_mul_fp8", dim, [x, res, "tanh"], [row, row, None], None, [row, row]),
            ("gelu_mul_fp8_static", dim, [x, res, "none", torch.tensor([0.05])], [row, row, None, R], None, [row]),
            ("geglu_fp8", dim, [torch.cat([x, res], -1), "none"], [row, None], None, [row, row]),
            ("geglu_fp8_static", dim, [torch.cat([x, res], -1), "tanh", torch.tensor([0.05])], [row, None, R], None,
             [row]),
            ("gated_residual_adaln_out", dim, [torch.empty_like(x), torch.empty_like(x), res, x, gate, scale, shift,
                                               1e-6, "rms"],
             [row, row, row, row, mod[2], *mod[:2], None, None], [0, 1], None),
            ("gated_residual_adaln_with_stats", dim, [res, x, gate, scale, shift, 1e-6, "layer"],
             [row, row, mod[2], *mod[:2], None, None], None, [row, row, row]),
            ("gated_residual_adaln_backward", dim, [go, extra, res, x, gate, scale, shift, 1e-6, "layer",
                                                    lki.ops.gated_residual_adaln_with_stats(
                                                        res, x, gate, scale, shift, 1e-6, "layer")[2]],
             [row, row, row, row, mod[2], *mod[:2], None, None, row], None, [row, row, grads[2], *grads[:2]]),
            ("geglu", dim, [rand(B, S, 2 * D), "none"], [row, None], None, [row]),
            ("geglu_out", dim, [torch.empty(B, S, D), rand(B, S, 2 * D), "none"], [row, row, None], [0], None),
            ("geglu_backward", dim, [go, rand(B, S, 2 * D), "none"], [row, row, None], None, [row]),
        ]
        # RoPE, transformers' layout: q [B, H, S, D], GQA k, tables [S, D]; and LTX's:
        # q/k [B, S, C] with fp32 tables [B, S, C].
        q, k, cos, sin = rand(B, 4, S, D), rand(B, 2, S, D), rand(S, D), rand(S, D)
        qk, table = (Shard(0), R) if dim == 0 else (Shard(2), Shard(0))
        cases += [
            ("rope", f"{qk}", [q, k, cos, sin, False, 2], [qk, qk, table, table, None, None], None, [qk, qk]),
            ("rope_out", f"{qk}", [torch.empty_like(q), torch.empty_like(k), q, k, cos, sin, True, 2],
             [qk, qk, qk, qk, table, table, None, None], [0, 1], None),
            ("rope_", f"{qk}", [q.clone(), k.clone(), cos, sin, False, 2], [qk, qk, table, table, None, None],
             [0, 1], None),
            ("rope_backward", f"{qk}", [q, k, cos, sin, True, 2], [qk, qk, table, table, None, None], None,
             [qk, qk]),
        ]
        q3, k3, cos3, sin3 = rand(B, S, 4 * D), rand(B, S, 4 * D), rand(B, S, 4 * D), rand(B, S, 4 * D)
        qw, kw = rand(4 * D), rand(4 * D)
        cases += [
            ("qk_norm_rope", dim, [q3, k3, qw, kw, cos3, sin3, 1e-5], [row, row, R, R, row, row, None], None,
             [row, row]),
            ("qk_norm_rope_out", dim, [torch.empty_like(q3), torch.empty_like(k3), q3, k3, qw, kw, cos3, sin3, 1e-5],
             [row, row, row, row, R, R, row, row, None], [0, 1], None),
        ]
    # Heads of [B, H, S, D] RoPE; pointwise ops on every dim, the last included.
    q, k, cos, sin = rand(B, 4, S, D), rand(B, 2, S, D), rand(S, D), rand(S, D)
    cases.append(("rope", "heads", [q, k, cos, sin, False, 2], [Shard(1), Shard(1), R, R, None, None], None,
                  [Shard(1), Shard(1)]))
    for dim in (0, 1, 2):
        p = Shard(dim)
        x, up, go, res = rand(B, S, D), rand(B, S, D), rand(B, S, D), rand(B, S, D)
        gate, gate_p, gate_grad = (rand(B, 1, D), Shard(2), Shard(2)) if dim == 2 else (rand(D), R, Partial())
        cases += [
            ("gelu", dim, [x, "tanh"], [p, None], None, [p]),
            ("gelu_out", dim, [torch.empty_like(x), x, "none"], [p, p, None], [0], None),
            ("gelu_backward", dim, [go, x, "tanh"], [p, p, None], None, [p]),
            ("gelu_mul", dim, [x, up, "tanh"], [p, p, None], None, [p]),
            ("gelu_mul_out", dim, [torch.empty_like(x), x, up, "tanh"], [p, p, p, None], [0], None),
            ("gelu_mul_backward", dim, [go, x, up, "none"], [p, p, p, None], None, [p, p]),
            ("gated_residual", dim, [res, x, gate], [p, p, gate_p], None, [p]),
            ("gated_residual_out", dim, [torch.empty_like(x), res, x, gate], [p, p, p, gate_p], [0], None),
            ("gated_residual_backward", dim, [go, x, gate], [p, p, gate_p], None, [p, gate_grad]),
        ]
    return cases


def case_ops(lki, rank, world) -> dict:
    """Each op on DTensors sharded as it is on a leading dim (and the pointwise ones on the
    last): the full result equals the op's on the full tensors, the results have the
    expected placements (weight, scale, shift and gate grads Partial where they broadcast
    over the split), and the call itself communicates nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh(DEVICE, (world,))
    record = {}
    for name, split, args, placements, written, expected_placements in op_cases(lki):
        op = getattr(lki.ops, name)
        args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]

        def run():
            plain = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            result = op(*plain)
            expected = [plain[i] for i in written] if written is not None else (
                list(result) if isinstance(result, tuple) else [result])
            dargs = [distribute_tensor(a, mesh, [p]) if p is not None else a for a, p in zip(args, placements)]
            with CommDebugMode() as comm:
                result = op(*dargs)
            actual = [dargs[i] for i in written] if written is not None else (
                list(result) if isinstance(result, tuple) else [result])
            found = [f"collectives in the call: {comm.get_comm_counts()}"] if comm.get_total_counts() else []
            for i, (a, e) in enumerate(zip(actual, expected)):
                if not isinstance(a, DTensor):
                    found.append(f"result {i} is a {type(a).__name__}, not a DTensor")
                    continue
                if expected_placements is not None and a.placements != (expected_placements[i],):
                    found.append(f"result {i} placed {a.placements}, expected ({expected_placements[i]},)")
                found += differences(a, e, 1e-6, f"result {i}")
            return found

        variant(record, f"{name} [{split}]", run)
    return record


# ---------------------------------------------------------------------------------------
# LTX-Video under diffusers' context parallelism.


def small_ltx():
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=16,
                                       cross_attention_dim=64, num_layers=2, caption_channels=32).eval()
    with torch.no_grad():  # random weights everywhere, the zero-initialised ones too
        for p in model.parameters():
            p.normal_(0.0, 0.5 / max(p.shape[-1], 1) ** 0.5 if p.dim() > 1 else 0.1)
    return model


def ltx_inputs():
    # No text mask: diffusers' Ulysses attention fails on one stock (it splits the mask
    # with the text tokens that the all-to-all gathers back).
    g = torch.Generator().manual_seed(1)
    batch, frames, height, width, text = 2, 2, 3, 4, 8
    return dict(hidden_states=torch.randn(batch, frames * height * width, 8, generator=g),
                encoder_hidden_states=torch.randn(batch, text, 32, generator=g), timestep=torch.tensor([500, 700]),
                encoder_attention_mask=None, num_frames=frames, height=height, width=width)


LTX_OPS = {"adaln", "gated_residual", "gated_residual_adaln", "qk_norm_rope", "rms_norm", "gelu"}


def case_ltx_context_parallel(lki, rank, world) -> dict:
    from diffusers import ContextParallelConfig

    base, inputs = small_ltx(), ltx_inputs()
    with torch.no_grad():
        expected = base(**inputs, return_dict=False)[0]
    enable = "enable_parallelism"
    steps = {  # variant -> (calls in order, whether our layers run at the end)
        "stock": ([enable], False),
        "kernelized before": ([lki.kernelize_diffusers, enable], True),
        "kernelized after": ([enable, lki.kernelize_diffusers], True),
        "kernelized before, unkernelized after": ([lki.kernelize_diffusers, enable, lki.unkernelize], False),
        "kernelized and unkernelized after": ([enable, lki.kernelize_diffusers, lki.unkernelize], False),
    }
    record = {}
    for attention in ("ulysses", "ring"):
        for name, (calls, ours) in steps.items():
            def run():
                model = copy.deepcopy(base)
                for call in calls:
                    if call == enable:
                        model.enable_parallelism(config=ContextParallelConfig(**{f"{attention}_degree": world}))
                    else:
                        call(model)
                with torch.no_grad(), OpsCalled() as called:
                    out = model(**inputs, return_dict=False)[0]
                found = differences(out, expected, OUTPUT_ATOL, "output")
                if ours and not LTX_OPS <= called.names:
                    found.append(f"ops run: {sorted(called.names)}, expected {sorted(LTX_OPS)}")
                if not ours and called.names:
                    found.append(f"stock model ran ltx-kernels ops {sorted(called.names)}")
                return found

            variant(record, f"{attention}: {name}", run)
    return record


# ---------------------------------------------------------------------------------------
# transformers LLMs: tensor parallelism (tp_plan="auto"), sequence parallelism, FSDP2.


def llm(family):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SMALL_LLM, attn_implementation="sdpa"))
    with torch.no_grad():  # non-trivial norm weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model.train()


def llm_batch():
    ids = torch.randint(0, SMALL_LLM["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, labels=ids, position_ids=torch.arange(12)[None].expand(2, -1))


def single_process_run(model, batch):
    """Logits, loss and grads of the single-process run."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def training_step_differences(model, batch, reference, expect_ours: bool, lki, local_partials=False) -> list:
    logits, loss, grads = reference
    model.zero_grad(set_to_none=True)
    with OpsCalled() as called:
        out = model(**batch)
        out.loss.backward()
    found = differences(out.logits, logits, OUTPUT_ATOL, "logits") + differences(out.loss, loss, OUTPUT_ATOL, "loss")
    found += grad_differences(model, grads, local_partials)
    ran = {"rms_norm", "rms_norm_backward", "rope", "rope_backward"} <= called.names
    if expect_ours and not ran:
        found.append(f"ops run: {sorted(called.names)}")
    if not expect_ours and called.names:
        found.append(f"stock model ran ltx-kernels ops {sorted(called.names)}")
    return found


def case_tensor_parallel(lki, rank, world, family, checkpoint: Path, sequence_parallel_norms=False) -> dict:
    """from_pretrained(tp_plan="auto"), kernelized after loading (the only order it allows).
    ``sequence_parallel_norms``: the plan also puts the decoder norms under transformers'
    sequence_parallel style, which installs itself as each norm's instance forward (with
    use_kernels=False: transformers' own kernelize at load drops that wrapper, stock). Each
    rank's activations are whole there, which the style takes as the rank's shard: each norm
    weight's grad is a Partial whose local part is the single-process grad."""
    from kernels import Mode
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM
    from transformers.distributed import DistributedConfig

    model_cls = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}[family]
    path = checkpoint / family
    if rank == 0 and not path.exists():
        llm(family).save_pretrained(path)
    dist.barrier()
    batch = llm_batch()
    reference = single_process_run(model_cls.from_pretrained(path, dtype=torch.float32).train(), batch)
    if sequence_parallel_norms:
        plan = {"model.layers.*.input_layernorm": "sequence_parallel",
                "model.layers.*.post_attention_layernorm": "sequence_parallel", "model.norm": "sequence_parallel"}
        loading = dict(distributed_config=DistributedConfig(tp_plan=plan), use_kernels=False)
    else:
        loading = dict(tp_plan="auto")
    record = {}
    for name in ("stock", "kernelized", "kernelized and unkernelized"):
        def run():
            model = model_cls.from_pretrained(path, dtype=torch.float32, **loading).train()
            if name != "stock":
                lki.kernelize_transformers(model, mode=Mode.TRAINING)
            if name.endswith("unkernelized"):
                lki.unkernelize(model)
            with torch.no_grad():
                found = differences(model(input_ids=batch["input_ids"]).logits, reference[0], OUTPUT_ATOL,
                                    "inference logits")
            found += training_step_differences(model, batch, reference, name == "kernelized", lki,
                                               local_partials=sequence_parallel_norms)
            return found + (_partial_norm_grads(model) if sequence_parallel_norms else [])

        variant(record, name, run)
    return record


def torch_sequence_parallel_plan(model):
    """torch's Megatron-style plan: norms under SequenceParallel (activations sharded on the
    sequence between the blocks), projections column- and row-wise."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, \
        SequenceParallel

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        layer = f"model.layers.{i}."
        plan.update({
            layer + "input_layernorm": SequenceParallel(),
            layer + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            layer + "self_attn.q_proj": ColwiseParallel(),
            layer + "self_attn.k_proj": ColwiseParallel(),
            layer + "self_attn.v_proj": ColwiseParallel(),
            layer + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            layer + "post_attention_layernorm": SequenceParallel(),
            layer + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            layer + "mlp.gate_proj": ColwiseParallel(),
            layer + "mlp.up_proj": ColwiseParallel(),
            layer + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def engine_variants(lki, family, parallelize, names=("stock", "kernelized before", "kernelized after"),
                    check=None, local_partials=False) -> dict:
    """A training step of ``family`` under ``parallelize(model)``, per variant: stock,
    kernelized before or after it, and unkernelized after that; ``check(model)`` adds
    what else differs."""
    from kernels import Mode

    base, batch = llm(family), llm_batch()
    reference = single_process_run(copy.deepcopy(base), batch)
    record = {}
    for name in names:
        def run():
            model = copy.deepcopy(base)
            if name == "kernelized before":
                lki.kernelize_transformers(model, mode=Mode.TRAINING)
            parallelize(model)
            if name.endswith("after"):
                lki.kernelize_transformers(model, mode=Mode.TRAINING)
            if name.endswith("unkernelized after"):
                lki.unkernelize(model)
            ours = name in ("kernelized before", "kernelized after")
            found = training_step_differences(model, batch, reference, ours, lki, local_partials)
            return found + (check(model) if check is not None else [])

        variant(record, name, run)
    return record


def case_sequence_parallel(lki, rank, world, family) -> dict:
    """torch's parallelize_module with SequenceParallel norms: the norms (and RoPE) run on
    sequence-sharded DTensors, through this package's sharding rules. Qwen3's per-head q/k
    norms see only this rank's heads: their grads are summed over the ranks as transformers'
    plan does it (its replicated_with_grad_allreduce style)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    mesh = init_device_mesh("cpu", (world,))

    def parallelize(model):
        parallelize_module(model, mesh, torch_sequence_parallel_plan(model))
        for head_norm in [m for n, m in model.named_modules() if n.endswith(("q_norm", "k_norm"))]:
            ALL_PARALLEL_STYLES["replicated_with_grad_allreduce"].install_forward(head_norm, mesh)

    return engine_variants(lki, family, parallelize)


def _sequence_parallel_norms(model):
    return [m for n, m in model.named_modules() if n.endswith("layernorm") or n == "model.norm"]


def _partial_norm_grads(model) -> list:
    """Under transformers' sequence_parallel style its norms' (DTensor) weights get Partial
    grads: what differs from that shows a style that did not run."""
    from torch.distributed.tensor import DTensor, Partial

    return [f"a sequence-parallel norm's weight grad is {type(g).__name__} {getattr(g, 'placements', '')}, "
            "not a Partial DTensor" for g in (norm.weight.grad for norm in _sequence_parallel_norms(model))
            if not (isinstance(g, DTensor) and g.placements == (Partial(),))]


def case_transformers_parallel_style(lki, rank, world) -> dict:
    """transformers' own parallel styles install themselves as the module's instance
    forward (TensorParallelLayer.install_forward): its sequence_parallel style on Qwen3's
    decoder norms. Each rank's activations are whole (replicated), which that style takes
    as the rank's shard: the outputs are the single-process ones, and each norm weight's
    grad is a Partial whose local part is the rank's single-process grad."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    mesh = init_device_mesh("cpu", (world,))

    def parallelize(model):
        for norm in _sequence_parallel_norms(model):
            ALL_PARALLEL_STYLES["sequence_parallel"].install_forward(norm, mesh)

    return engine_variants(lki, "qwen3", parallelize, ("stock", "kernelized before", "kernelized after",
                                                       "kernelized and unkernelized after"), _partial_norm_grads,
                           local_partials=True)


def case_fsdp2(lki, rank, world, family) -> dict:
    """fully_shard on each decoder layer and the model; both ranks train on the same batch,
    so the averaged grads are the single-process ones."""
    from torch.distributed.fsdp import fully_shard

    def parallelize(model):
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)

    return engine_variants(lki, family, parallelize)


def cases(checkpoint: Path) -> dict:
    return {
        "ops": case_ops,
        "ltx context parallel": case_ltx_context_parallel,
        "qwen3 tp_plan=auto": lambda lki, rank, world: case_tensor_parallel(lki, rank, world, "qwen3", checkpoint),
        "llama tp_plan=auto": lambda lki, rank, world: case_tensor_parallel(lki, rank, world, "llama", checkpoint),
        "qwen3 tp_plan with sequence_parallel norms": lambda lki, rank, world: case_tensor_parallel(
            lki, rank, world, "qwen3", checkpoint, sequence_parallel_norms=True),
        "qwen3 sequence parallel": lambda lki, rank, world: case_sequence_parallel(lki, rank, world, "qwen3"),
        "llama sequence parallel": lambda lki, rank, world: case_sequence_parallel(lki, rank, world, "llama"),
        "transformers parallel style": case_transformers_parallel_style,
        "qwen3 fsdp2": lambda lki, rank, world: case_fsdp2(lki, rank, world, "qwen3"),
        "llama fsdp2": lambda lki, rank, world: case_fsdp2(lki, rank, world, "llama"),
    }


def main(out_dir: Path, selected: list) -> None:
    # A rank killed by a signal (an abort of glibc's heap checks, a segfault) prints the Python
    # stack of each thread to its log.
    faulthandler.enable()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if DEVICE == "cuda" and selected != ["ops"]:
        raise SystemExit("LTX_WORKER_DEVICE=cuda runs the ops case only: pass `ops` as the one case")
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        lki = load_kernel()
        cpu_shims()
        for name, case in cases(out_dir / "checkpoints").items():
            if selected and name not in selected:
                continue
            print(f"{PROGRESS} case {name}", flush=True)
            try:
                results[name] = case(lki, rank, world)
            except Exception:
                results[name] = {"setup": {"differences": [], "error": traceback.format_exc(limit=-8)}}
            dist.barrier()
    finally:
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
        dist.destroy_process_group()
    print(f"{PROGRESS} {RESULTS_WRITTEN}", flush=True)
    sys.stderr.flush()
    # Nothing is left to record: skip the interpreter's teardown (the destructors of gloo,
    # dynamo and the models' objects), which adds nothing to what the test checks.
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
