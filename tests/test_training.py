"""A training step through our layers: small Llama and LTX-Video models, kernelized for
Mode.TRAINING (which only picks layers with has_backward), give the stock models'
gradients for every parameter; and compiled with fullgraph=True they still do."""

import copy

import pytest
import torch

from conftest import TARGETS

pytest.importorskip("transformers", reason="requirements-dev.txt installs transformers")
pytest.importorskip("diffusers", reason="requirements-dev.txt installs diffusers")
from kernels import Mode  # noqa: E402
from test_integration_diffusers import ltx_inputs, small_ltx  # noqa: E402
from test_integration_transformers import FAMILIES, SMALL, lki  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

DEVICES = sorted({d for _, d in TARGETS})


def _grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(actual, expected):
    assert actual.keys() == expected.keys()
    for name, g in expected.items():
        scale = max(g.abs().max().item(), 1e-6)
        torch.testing.assert_close(actual[name], g, rtol=0, atol=2e-4 * scale, msg=name)


def _needs(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU on this machine (these run on the device)")


@pytest.mark.parametrize("device", DEVICES)
def test_llama_training_step(device):
    _needs(device)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).to(device).train()
    stock = copy.deepcopy(model)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), device=device)
    loss = lambda m: m(input_ids=ids, labels=ids).loss  # noqa: E731
    try:
        counts = lki.kernelize_transformers(model, mode=Mode.TRAINING)
        assert counts == FAMILIES["llama"][2]
        _assert_same_grads(_grads(model, loss), _grads(stock, loss))
    finally:
        lki.unkernelize(model)


@pytest.mark.parametrize("device", DEVICES)
def test_ltx_training_step_eager_and_compiled(device):
    _needs(device)
    import torch._dynamo

    model = small_ltx(device, torch.float32).train()
    stock = copy.deepcopy(model)
    inputs = ltx_inputs(device, torch.float32)
    loss = lambda m: m(**inputs, return_dict=False)[0].square().mean()  # noqa: E731
    counts = lki.kernelize_diffusers(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE)
    assert counts["LTXVideoTransformerBlock"] == 2
    expected = _grads(stock, loss)
    _assert_same_grads(_grads(model, loss), expected)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _assert_same_grads(_grads(compiled, loss), {f"_orig_mod.{k}": v for k, v in expected.items()})
