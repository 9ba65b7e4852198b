"""kernels.kernelize with this package's layers on small transformers models built from
their real classes and configs (no downloads): the intended modules are replaced (counted),
others are left alone, and outputs match the stock model."""

import copy

import pytest
import torch

from conftest import REPO, TARGETS

transformers = pytest.importorskip("transformers", reason="requirements-dev.txt installs transformers")
from kernels import LocalLayerRepository, Mode, kernelize, replace_kernel_forward_from_hub, use_kernel_mapping  # noqa: E402
from transformers import (GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,  # noqa: E402
                          MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402

# kernelize loads torch's own backend (the CUDA variant under a CUDA torch, whose CPU twins
# serve CPU tensors), so the device under test is all that varies.
DEVICES = sorted({d for _, d in TARGETS})
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)

# Gemma's RMSNorm has no hub hook: tag it, as a user would.
replace_kernel_forward_from_hub(GemmaRMSNorm, "RMSNormZeroCentered")


def mapping(layers):
    return {name: {device: LocalLayerRepository(REPO, layer_name=name) for device in ("cpu", "cuda")}
            for name in layers}


FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"RMSNorm": 5}),
    "mistral": (MistralConfig, MistralForCausalLM, {"RMSNorm": 5}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"RMSNorm": 9}),  # + per-head q/k norms
    "gemma": (GemmaConfig, GemmaForCausalLM, {"RMSNormZeroCentered": 5}),
}


def replaced(model, layer_name):
    """Modules whose forward kernelize bound to our layer of that name."""
    return [m for m in model.modules()
            if getattr(getattr(m, "forward", None), "__func__", None) is not None
            and m.forward.__func__.__qualname__ == f"{layer_name}.forward"
            and m.forward.__func__.__module__.endswith("layers")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_kernelized_model_matches_stock(family, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU on this machine (these run on the device)")
    config_cls, model_cls, expected = FAMILIES[family]
    torch.manual_seed(0)
    stock = model_cls(config_cls(**SMALL)).to(device).eval()
    with torch.no_grad():  # non-trivial norm weights
        for name, p in stock.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if family == "gemma" else 1.0, 0.1)
    ours = copy.deepcopy(stock)
    with use_kernel_mapping(mapping(expected)):
        ours = kernelize(ours, mode=Mode.INFERENCE, device=device)
    for layer_name, count in expected.items():
        assert len(replaced(ours, layer_name)) == count, f"{layer_name}: {len(replaced(ours, layer_name))} replaced"
    assert not any(isinstance(m, torch.nn.Linear) and m.forward.__func__.__module__.endswith("layers")
                   for m in ours.modules()), "modules without a mapping are left alone"
    ids = torch.randint(0, SMALL["vocab_size"], (2, 11), device=device)
    with torch.no_grad():
        expected_logits = stock(ids).logits
        logits = ours(ids).logits
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_tanh_layer(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU on this machine (these run on the device)")
    from transformers.activations import GELUTanh

    module = torch.nn.Sequential(GELUTanh()).to(device)
    stock = copy.deepcopy(module)
    with use_kernel_mapping(mapping(["GeluTanh"])):
        kernelize(module, mode=Mode.INFERENCE, device=device)
    assert len(replaced(module, "GeluTanh")) == 1
    x = torch.randn(4, 257, device=device)
    torch.testing.assert_close(module(x), stock(x))


def test_every_layer_follows_the_kernelize_rules(kernel):
    """kernels binds only stateless layers: no __init__, no members beyond its two flags
    (type annotations are fine), and forward only for now (the flags say so)."""
    import inspect

    layers = [obj for obj in vars(kernel.layers).values()
              if inspect.isclass(obj) and issubclass(obj, torch.nn.Module) and obj.__module__ == kernel.layers.__name__]
    assert {layer.__name__ for layer in layers} == {
        "RMSNorm", "RMSNormZeroCentered", "GeluTanh", "ApplyRotaryPosEmb", "DiffusersRMSNorm", "GEGLU", "DiffusersGELU",
        "AdaLayerNormZero", "AdaLayerNormZeroSingle", "AdaLayerNormContinuous", "LTXVideoTransformerBlock",
        "LTXAttention", "LTXVideoRotaryPosEmbed", "FeedForward"}
    module_members = {name for name, _ in inspect.getmembers(torch.nn.Module)}
    for layer in layers:
        assert layer.__init__ is torch.nn.Module.__init__, layer
        assert {name for name, _ in inspect.getmembers(layer)} - module_members <= {"has_backward", "can_torch_compile"}
        assert layer.has_backward is True and layer.can_torch_compile is True, layer
