"""kernelize_transformers (the kernel package's integration module) on small transformers
models built from their real classes and configs (no downloads): what it replaces
(counted), what it leaves alone, outputs against the stock model, models kernelized one by
one, and the calls it refuses."""

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import REPO, TARGETS, load_variant

transformers = pytest.importorskip("transformers", reason="requirements-dev.txt installs transformers")
from kernels import Mode, use_kernel_forward_from_hub, use_kernelized_func  # noqa: E402
from transformers import (GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,  # noqa: E402
                          MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

# The variant of torch's backend, as get_kernel loads it (its CPU twins serve CPU tensors).
lki = load_variant(TARGETS[-1][0])
DEVICES = sorted({d for _, d in TARGETS})
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
# The rotary hook's wrappers: one per attention module (kernels >= 0.18), or one per model
# file shared by every model of that type (kernels 0.17).
SHARED_ROTARY = lki.integration._shared_function_wrappers()
ROTARY = 1 if SHARED_ROTARY else SMALL["num_hidden_layers"]
# Per model: layer -> modules replaced.
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"RMSNorm": 5, "ApplyRotaryPosEmb": ROTARY}),
    "mistral": (MistralConfig, MistralForCausalLM, {"RMSNorm": 5, "ApplyRotaryPosEmb": ROTARY}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"RMSNorm": 9, "ApplyRotaryPosEmb": ROTARY}),  # + per-head q/k norms
    "gemma": (GemmaConfig, GemmaForCausalLM, {"RMSNormZeroCentered": 5, "GeluTanh": 2, "ApplyRotaryPosEmb": ROTARY}),
}
# Logits of the 2-layer models: fp32 agrees to rounding; bf16 differs by the roundings the
# host makes and the kernels do not (a few bf16 ulps of values up to ~1).
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2}
needs_own_wrappers = pytest.mark.skipif(SHARED_ROTARY, reason="kernels 0.17 shares the rotary hook per model file")


def needs_device(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU on this machine (these run on the device)")


@pytest.fixture
def models_to_restore():
    """Models to unkernelize after the test: with kernels 0.17 the rotary hook is shared by
    every model of a model file in the process, and a kernelized one must not leak into
    other tests."""
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


def stock_forwards(model) -> bool:
    """No module or hooked-function wrapper of ``model`` has a forward of its own."""
    return not [m for m in lki.integration._hooked(model) if "forward" in vars(m)]


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

    assert counts == FAMILIES[family][2] == lki.replaced_modules(ours)
    if not SHARED_ROTARY:  # the model it was copied from keeps its own stock wrappers
        assert lki.replaced_modules(stock) == {} and stock_forwards(stock)
    act = ours.model.layers[0].mlp.act_fn
    if family != "gemma":  # SiLU is hooked by transformers but not mapped: stock forward
        assert "forward" not in vars(act) or vars(act)["forward"].__func__ is type(act).forward
    assert not any("forward" in vars(m) for m in ours.modules() if isinstance(m, torch.nn.Linear))
    with torch.no_grad(), OpsCalled() as called:
        logits = ours(ids).logits
    assert {"rms_norm", "rope"} <= called.names
    torch.testing.assert_close(logits.float(), expected.float(), rtol=0, atol=LOGIT_TOLERANCE[dtype])


def run(model, ids):
    """Logits and the names of this package's ops that ran."""
    with torch.no_grad(), OpsCalled() as called:
        return model(ids).logits, called.names


@needs_own_wrappers
@pytest.mark.parametrize("family", list(FAMILIES))
def test_models_are_kernelized_one_by_one(family):
    """Each model has its own rotary wrappers: kernelizing one leaves another of the same
    class stock, kernelizing it twice changes nothing, and unkernelizing it leaves the
    other kernelized."""
    first, second = small_model(family, "cpu", torch.float32), small_model(family, "cpu", torch.float32)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    expected, _ = run(second, ids)

    counts = lki.kernelize_transformers(first)
    assert lki.replaced_modules(second) == {} and stock_forwards(second)
    logits, ops = run(second, ids)
    assert ops == set() and torch.equal(logits, expected)

    assert lki.kernelize_transformers(first) == counts == lki.replaced_modules(first)
    twice, ops = run(first, ids)
    assert {"rms_norm", "rope"} <= ops
    torch.testing.assert_close(twice, expected, rtol=0, atol=LOGIT_TOLERANCE[torch.float32])

    assert lki.kernelize_transformers(second) == counts
    lki.unkernelize(first)
    assert lki.replaced_modules(first) == {} and stock_forwards(first)
    assert run(first, ids)[1] == set() and lki.replaced_modules(second) == counts
    assert {"rms_norm", "rope"} <= run(second, ids)[1]
    lki.unkernelize(second)


@needs_own_wrappers
def test_copies_of_kernelized_and_stock_models():
    """copy.deepcopy of a kernelized model is kernelized on its own wrappers (unkernelizing
    either leaves the other as it was); a copy of a stock model stays stock when the
    original is kernelized, and can be kernelized itself."""
    model = small_model("qwen3", "cpu", torch.float32)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 7))
    expected, _ = run(model, ids)
    stock_copy = copy.deepcopy(model)
    counts = lki.kernelize_transformers(model)
    kernelized_copy = copy.deepcopy(model)

    assert lki.replaced_modules(kernelized_copy) == counts and lki.replaced_modules(stock_copy) == {}
    logits, ops = run(kernelized_copy, ids)
    assert {"rms_norm", "rope"} <= ops
    torch.testing.assert_close(logits, expected, rtol=0, atol=LOGIT_TOLERANCE[torch.float32])
    assert run(stock_copy, ids)[1] == set()

    lki.unkernelize(model)
    assert {"rms_norm", "rope"} <= run(kernelized_copy, ids)[1] and run(model, ids)[1] == set()
    lki.unkernelize(kernelized_copy)
    assert run(kernelized_copy, ids)[1] == set()
    assert lki.kernelize_transformers(stock_copy) == counts
    assert {"rms_norm", "rope"} <= run(stock_copy, ids)[1]


def test_unkernelize_restores_the_stock_model(models_to_restore):
    model = small_model("qwen3", "cpu", torch.float32)
    models_to_restore.append(model)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 5))
    expected, _ = run(model, ids)
    lki.kernelize_transformers(model)
    lki.unkernelize(model)
    assert lki.replaced_modules(model) == {} and stock_forwards(model)
    assert not [m for m in lki.integration._hooked(model) if "_kernel_repo" in vars(m)]
    logits, ops = run(model, ids)
    assert ops == set() and torch.equal(logits, expected)


def test_unmapped_hooks_are_not_logged(caplog, models_to_restore):
    """transformers hooks SiLU and more, which the mapping leaves stock: kernels' warning
    for each is filtered, under the logger name of kernels >= 0.19 and of older ones."""
    model = small_model("llama", "cpu", torch.float32)
    models_to_restore.append(model)

    def unmapped():
        return [r for r in caplog.records if "No kernel mapping found" in r.getMessage()]

    with caplog.at_level(logging.WARNING):
        lki.kernelize_transformers(model)
        with lki.integration._quiet_unmapped_hooks():
            for name in ("kernels.layer.layer", "kernels._internals.layer.layer"):
                logging.getLogger(name).warning("No kernel mapping found for layer `SiLU`.")
        assert unmapped() == []
        logging.getLogger("kernels._internals.layer.layer").warning("No kernel mapping found for layer `SiLU`.")
        assert len(unmapped()) == 1  # the filter is gone after the call


def test_inert_hooks_are_refused_with_the_versions_to_use(monkeypatch):
    """transformers replaces its hub decorators with no-op stubs when the installed kernels
    is outside its pin (their models then have no hooks): refused, naming the versions.
    Here the stubs are put in place by hand."""
    import kernels
    from transformers.integrations import hub_kernels
    from transformers.utils.import_utils import KERNELS_MAX_VERSION, KERNELS_MIN_VERSION

    def stub(*args, **kwargs):
        return lambda decorated: decorated

    monkeypatch.setattr(hub_kernels, "use_kernel_forward_from_hub", stub)
    monkeypatch.setattr(hub_kernels, "use_kernelized_func", stub)
    lki.integration._inert_transformers_hooks.cache_clear()
    try:
        with pytest.raises(RuntimeError) as refused:
            lki.kernelize_transformers(small_model("gemma", "cpu", torch.float32))
    finally:
        monkeypatch.undo()
        lki.integration._inert_transformers_hooks.cache_clear()
    message = str(refused.value)
    assert f"inert (transformers {transformers.__version__}, kernels {kernels.__version__})" in message
    assert f"pip install 'kernels>={KERNELS_MIN_VERSION},<{KERNELS_MAX_VERSION}'" in message
    assert "transformers >= 5.25 with kernels >= 0.19.1, < 0.20" in message
    assert "transformers 5.22 with kernels >= 0.17.2, < 0.18" in message
    assert lki.integration._inert_transformers_hooks() is None


def test_a_kernelize_that_binds_nothing_is_refused(monkeypatch):
    """Hooks present but nothing bound (a kernels whose kernelize ignores them): an error,
    not a stock model reported as kernelized."""
    import kernels

    monkeypatch.setattr(kernels, "kernelize", lambda model, **kwargs: model)
    model = small_model("llama", "cpu", torch.float32)
    with pytest.raises(RuntimeError, match=r"bound none of the 7 hooked modules of LlamaForCausalLM"
                       if not SHARED_ROTARY else "bound none"):
        lki.kernelize_transformers(model)
    assert stock_forwards(model)


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
    for wrapper in (*model._kernel_funcs.values(), rotation_with_the_other_sign):
        assert "forward" not in vars(wrapper)


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


@pytest.mark.parametrize("source", ["loaded-package", "cpu-variant-loaded", "get_kernel-with-LOCAL_KERNELS",
                                    "cpu-variant-of-a-checkout", "hub-id-with-LOCAL_KERNELS"])
def test_where_the_layers_come_from(source, monkeypatch, models_to_restore):
    """By default the layers of the very package the integration was loaded from; repo=
    a checkout (backend= its variant) or a Hub repo id."""
    model = small_model("llama", "cpu", torch.float32)
    models_to_restore.append(model)
    cpu = load_variant("cpu")
    if source == "loaded-package":
        counts, expected_module = lki.kernelize_transformers(model), lki.__name__
    elif source == "cpu-variant-loaded":
        counts, expected_module = cpu.kernelize_transformers(model), cpu.__name__
    elif source == "get_kernel-with-LOCAL_KERNELS":  # as a user loads it from the Hub, resolved to this checkout
        from kernels import get_kernel

        monkeypatch.setenv("LOCAL_KERNELS", f"{lki.integration.HUB_REPO_ID}={REPO}")
        hub_kernel = get_kernel(lki.integration.HUB_REPO_ID, revision="main", trust_remote_code=True)
        counts, expected_module = hub_kernel.kernelize_transformers(model), hub_kernel.__name__
    elif source == "cpu-variant-of-a-checkout":
        counts, expected_module = lki.kernelize_transformers(model, REPO, backend="cpu"), cpu.__name__
    else:  # kernels resolves the Hub id to this checkout; a revision needs no network
        hub_id = lki.integration.HUB_REPO_ID
        monkeypatch.setenv("LOCAL_KERNELS", f"{hub_id}={REPO}")
        counts = lki.kernelize_transformers(model, hub_id, revision="main", trust_remote_code=True)
        expected_module = lki.__name__  # torch's backend, as get_kernel picks it
    assert counts == FAMILIES["llama"][2]
    assert vars(model.model.norm)["forward"].__func__.__module__ == f"{expected_module}.layers"
    with pytest.raises(ValueError, match="without repo="):
        lki.kernelize_transformers(model, backend="cpu")


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
    assert lki.kernelize_transformers(model, mode=Mode.TRAINING) == FAMILIES["llama"][2]
    with pytest.raises(ValueError, match="no module ltx-kernels replaces"):
        lki.kernelize_transformers(torch.nn.Sequential(torch.nn.Linear(4, 4)), mode=Mode.TORCH_COMPILE)
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
    assert lki.kernelize_transformers(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE) == {}
    assert lki.replaced_modules(model) == {}
    assert not [m for m in lki.integration._hooked(model) if "forward" in vars(m)]
