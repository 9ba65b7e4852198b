"""ltx_kernels_integration.kernelize_transformers on small transformers models built from
their real classes and configs (no downloads): what it replaces (counted), what it leaves
alone, outputs against the stock model, and the calls it refuses."""

import copy
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import REPO, TARGETS

transformers = pytest.importorskip("transformers", reason="requirements-dev.txt installs transformers")
sys.path.insert(0, str(REPO))  # the integration module lives at the repo root, beside the kernel package
import ltx_kernels_integration as lki  # noqa: E402
from kernels import use_kernel_forward_from_hub, use_kernelized_func  # noqa: E402
from transformers import (GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,  # noqa: E402
                          MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

DEVICES = sorted({d for _, d in TARGETS})
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
# Per model: layer -> modules replaced (the rotary hook is one function per model file).
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"RMSNorm": 5, "ApplyRotaryPosEmb": 1}),
    "mistral": (MistralConfig, MistralForCausalLM, {"RMSNorm": 5, "ApplyRotaryPosEmb": 1}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"RMSNorm": 9, "ApplyRotaryPosEmb": 1}),  # + per-head q/k norms
    "gemma": (GemmaConfig, GemmaForCausalLM, {"RMSNormZeroCentered": 5, "GeluTanh": 2, "ApplyRotaryPosEmb": 1}),
}
# Logits of the 2-layer models: fp32 agrees to rounding; bf16 differs by the roundings the
# host makes and the kernels do not (a few bf16 ulps of values up to ~1).
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2}


def needs_device(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU on this machine (these run on the device)")


@pytest.fixture
def models_to_restore():
    """Models to unkernelize after the test: the rotary hook is shared by every model of a
    model file in the process, so a kernelized one must not leak into other tests."""
    models = []
    yield models
    for model in models:
        lki.unkernelize(model)


class OpsCalled(TorchDispatchMode):
    """Names of this package's ops dispatched inside the block (e.g. {"rms_norm"})."""

    def __enter__(self):
        self.names = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func.name().partition("::")
        if namespace.startswith("_ltx_kernels"):
            self.names.add(name.split(".")[0])
        return func(*args, **(kwargs or {}))


def small_model(family, device, dtype):
    config_cls, model_cls, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SMALL)).to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # non-trivial norm weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if family == "gemma" else 1.0, 0.1)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_kernelized_model_matches_stock(family, device, dtype, models_to_restore):
    needs_device(device)
    stock = small_model(family, device, dtype)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 11), device=device)
    with torch.no_grad():
        expected = stock(ids).logits  # before kernelizing
    ours = copy.deepcopy(stock)
    models_to_restore.append(ours)

    counts = lki.kernelize_transformers(ours)

    assert counts == FAMILIES[family][2]
    # The rotary hook is one function per model file: the stock model runs ours now too.
    assert lki.replaced_modules(stock) == {"ApplyRotaryPosEmb": 1}
    act = ours.model.layers[0].mlp.act_fn
    if family != "gemma":  # SiLU is hooked by transformers but not mapped: stock forward
        assert "forward" not in vars(act) or vars(act)["forward"].__func__ is type(act).forward
    assert not any("forward" in vars(m) for m in ours.modules() if isinstance(m, torch.nn.Linear))
    with torch.no_grad(), OpsCalled() as called:
        logits = ours(ids).logits
    assert {"rms_norm", "rope"} <= called.names
    torch.testing.assert_close(logits.float(), expected.float(), rtol=0, atol=LOGIT_TOLERANCE[dtype])


def test_unkernelize_restores_the_stock_model(models_to_restore):
    model = small_model("qwen3", "cpu", torch.float32)
    models_to_restore.append(model)
    lki.kernelize_transformers(model)
    lki.unkernelize(model)
    assert lki.replaced_modules(model) == {}
    with torch.no_grad(), OpsCalled() as called:
        model(torch.randint(0, SMALL["vocab_size"], (1, 5)))
    assert called.names == set()


@use_kernel_forward_from_hub("rotary_pos_emb")
def rotation_with_the_other_sign(q, k, cos, sin, unsqueeze_dim=1):
    """nanochat's apply_rotary_pos_emb: the hook's name and signature, other math."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate(x):
        half = x.shape[-1] // 2
        return torch.cat((x[..., half:], -x[..., :half]), dim=-1)

    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


@use_kernelized_func(rotation_with_the_other_sign)
class AttentionWithOtherRotation(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = LlamaRMSNorm(8)


def test_rotary_hook_with_other_math_is_left_alone(models_to_restore):
    model = AttentionWithOtherRotation()
    models_to_restore.append(model)
    assert lki.kernelize_transformers(model) == {"RMSNorm": 1}
    assert "forward" not in vars(rotation_with_the_other_sign) or \
        vars(rotation_with_the_other_sign)["forward"].__func__ is type(rotation_with_the_other_sign).forward


def test_rotary_layer_falls_back_where_the_host_promotes(models_to_restore):
    """fp32 tables with bf16 q: the host returns fp32; the layer gives the host's answer."""
    model = small_model("llama", "cpu", torch.bfloat16)
    models_to_restore.append(model)
    lki.kernelize_transformers(model)
    rotary, = model.model.layers[0].self_attn._kernel_funcs.values()
    q, k = torch.randn(1, 4, 5, 16, dtype=torch.bfloat16), torch.randn(1, 2, 5, 16, dtype=torch.bfloat16)
    cos, sin = torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    for ours, stock in zip(rotary(q, k, cos, sin), type(rotary).forward(rotary, q, k, cos, sin)):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, stock, rtol=0, atol=0)


@pytest.mark.parametrize("source", ["cpu-variant", "hub-id-with-LOCAL_KERNELS"])
def test_layers_from_the_cpu_variant_and_a_hub_repo_id(source, monkeypatch, models_to_restore):
    model = small_model("llama", "cpu", torch.float32)
    models_to_restore.append(model)
    if source == "cpu-variant":
        counts = lki.kernelize_transformers(model, REPO, backend="cpu")
        expected_module = "_ltx_kernels_cpu_"
    else:  # kernels resolves the Hub id to this checkout; a revision needs no network
        monkeypatch.setenv("LOCAL_KERNELS", f"{lki.HUB_REPO_ID}={REPO}")
        counts = lki.kernelize_transformers(model, lki.HUB_REPO_ID, revision="main")
        expected_module = "_ltx_kernels_"
    assert counts == FAMILIES["llama"][2]
    assert vars(model.model.norm)["forward"].__func__.__module__.startswith(expected_module)


def test_refuses_models_not_ready():
    with torch.device("meta"):
        on_meta = LlamaForCausalLM(LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match="meta device"):
        lki.kernelize_transformers(on_meta)
    on_cpu = LlamaRMSNorm(8)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"call \.to\('cuda'\)"):
            lki.kernelize_transformers(on_cpu, device="cuda")
    on_cpu._hf_hook = SimpleNamespace(hooks=[type("CpuOffload", (), {})()])  # accelerate's model offload hook
    with pytest.raises(ValueError, match="before enable_model_cpu_offload"):
        lki.kernelize_transformers(on_cpu)


def test_refuses_a_model_with_nothing_to_replace(models_to_restore):
    with pytest.raises(ValueError, match="no module ltx-kernels replaces"):
        lki.kernelize_transformers(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    model = small_model("llama", "cpu", torch.float32)
    models_to_restore.append(model)
    # Every layer has a backward: training mode replaces as much.
    assert lki.kernelize_transformers(model, mode=lki.Mode.TRAINING) == FAMILIES["llama"][2]
    with pytest.raises(ValueError, match="no module ltx-kernels replaces"):
        lki.kernelize_transformers(torch.nn.Sequential(torch.nn.Linear(4, 4)), mode=lki.Mode.TORCH_COMPILE)
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        lki.kernelize_transformers("meta-llama/Llama-3.2-1B")


def test_compiled_models_leave_the_layers_work_to_inductor(models_to_restore):
    """Under torch.compile the transformers layers trace the host's code, which inductor
    fuses with its neighbours (see layers._under_torch_compile); eager calls run the kernels."""
    model = small_model("qwen3", "cpu", torch.float32)
    models_to_restore.append(model)
    lki.kernelize_transformers(model)
    traced = set()

    def recording_backend(graph_module, example_inputs):
        traced.update(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=recording_backend)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = compiled(ids, use_cache=False).logits
        with OpsCalled() as eager:
            want = model(ids, use_cache=False).logits
    assert traced and not [op for op in traced if "_ltx_kernels" in op]
    assert eager.names == {"rms_norm", "rope"}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "gemma"])
def test_compile_mode_leaves_the_model_stock(family, models_to_restore):
    """Under Mode.TORCH_COMPILE kernelize_transformers installs nothing: no per-module
    forward for dynamo to guard, and torch.compile sees the stock model."""
    model = small_model(family, "cpu", torch.float32)
    models_to_restore.append(model)
    assert lki.kernelize_transformers(model)  # kernelized for eager first: compile mode undoes it
    assert lki.kernelize_transformers(model, mode=lki.Mode.INFERENCE | lki.Mode.TORCH_COMPILE) == {}
    assert lki.replaced_modules(model) == {}
    assert not [m for m in lki._hooked(model) if "forward" in vars(m)]
