"""kernelize / unkernelize compose with the hooks other libraries put on the same modules,
in either order: diffusers' First-Block-Cache against stock + First-Block-Cache (same
outputs, same cache hits), diffusers' hooks in general (pre/post and new_forward kinds, on the
block, the attention and the rotary module), accelerate's hooks; a forward wrapper nothing
can see into is refused, naming the order that works. The multi-process engines (context,
tensor and sequence parallelism, FSDP2) are in test_multi_process.py."""

import copy

import pytest
import torch

from test_integration_transformers import OpsCalled, lki, small_model

pytest.importorskip("diffusers", reason="requirements-dev.txt installs diffusers")
from diffusers import LTXVideoTransformer3DModel  # noqa: E402
from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, ModelHook, apply_first_block_cache  # noqa: E402
from kernels import Mode  # noqa: E402

LTX_OPS = {"adaln", "gated_residual", "gated_residual_adaln", "qk_norm_rope", "rms_norm", "gelu"}


def small_ltx(layers=3):
    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=16,
                                       cross_attention_dim=64, num_layers=layers, caption_channels=32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 / max(p.shape[-1], 1) ** 0.5 if p.dim() > 1 else 0.1)
    return model


def denoising_steps(model, steps=6):
    """A denoising loop's calls (inputs drifting slowly, as between sampler steps): the
    outputs and the names of this package's ops that ran."""
    g = torch.Generator().manual_seed(3)
    batch, frames, height, width, text = 2, 2, 3, 4, 8
    hidden = torch.randn(batch, frames * height * width, 8, generator=g)
    encoder = torch.randn(batch, text, 32, generator=g)
    outputs = []
    with torch.no_grad(), model.cache_context("cond"), OpsCalled() as called:
        for step in range(steps):
            timestep = torch.tensor([900 - 10 * step] * batch)
            outputs.append(model(hidden_states=hidden + 1e-3 * step, encoder_hidden_states=encoder, timestep=timestep,
                                 encoder_attention_mask=None, num_frames=frames, height=height, width=width,
                                 return_dict=False)[0])
    return outputs, called.names


class CacheHits:
    """Counts First-Block-Cache's decisions: True where a step reused the cached blocks."""

    def __init__(self, model):
        hook = model.transformer_blocks[0]._diffusers_hook.get_hook("fbc_leader_block_hook")
        decide = hook._should_compute_remaining_blocks
        self.decisions = []

        def counted(residual):
            compute = decide(residual)
            self.decisions.append(not compute)
            return compute

        hook._should_compute_remaining_blocks = counted


def steps_of(order: str) -> list:
    return [step.removeprefix("then ") for step in order.split(", ")]


def assert_steps_match(actual, expected):
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-5 * e.abs().max().item(), msg=f"step {step}")


FBC_ORDERS = ["cache, then kernelize", "kernelize, then cache", "cache, kernelize, unkernelize",
              "kernelize, cache, unkernelize"]


@pytest.mark.parametrize("order", FBC_ORDERS)
def test_first_block_cache(order):
    """Against stock + First-Block-Cache: the same outputs, the same steps served from the
    cache (some, or the test proves nothing: those differ from the uncached run), and our
    layers running where the model is kernelized."""
    base = small_ltx()
    uncached, _ = denoising_steps(copy.deepcopy(base))
    stock = copy.deepcopy(base)
    apply_first_block_cache(stock, FirstBlockCacheConfig(threshold=0.05))
    stock_hits = CacheHits(stock)
    expected, _ = denoising_steps(stock)
    assert any(stock_hits.decisions) and not all(stock_hits.decisions)
    assert max((e - u).abs().max() for e, u in zip(expected, uncached)) > 1e-4  # cached steps differ

    model = copy.deepcopy(base)
    for step in steps_of(order):
        if step.endswith("unkernelize"):
            lki.unkernelize(model)
        elif step.endswith("kernelize"):
            counts = lki.kernelize_diffusers(model)
            assert counts["LTXVideoTransformerBlock"] == 3
        else:
            apply_first_block_cache(model, FirstBlockCacheConfig(threshold=0.05))
    hits = CacheHits(model)
    actual, ops = denoising_steps(model)

    assert hits.decisions == stock_hits.decisions
    assert_steps_match(actual, expected)
    if order.endswith("unkernelize"):
        assert ops == set() and lki.replaced_modules(model) == {}
        for a, e in zip(actual, expected):
            assert torch.equal(a, e)
    else:
        assert LTX_OPS <= ops


class CountingHook(ModelHook):
    """A diffusers hook of the pre/post kind: counts the calls it wraps."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs


class ScalingHook(ModelHook):
    """A diffusers hook of the new_forward kind (as First-Block-Cache's): calls the forward
    it wrapped and scales the output, so that its dropping shows in the output."""

    def new_forward(self, module, *args, **kwargs):
        output = self.fn_ref.original_forward(*args, **kwargs)
        if isinstance(output, tuple):
            return tuple(o * 0.5 for o in output)
        return output * 0.5


def hook_everything(model):
    hooks = []
    for module in (model.rope, model.transformer_blocks[0], model.transformer_blocks[1].attn1):
        registry = HookRegistry.check_if_exists_or_initialize(module)
        counting, scaling = CountingHook(), ScalingHook()
        registry.register_hook(counting, "count")
        registry.register_hook(scaling, "scale")
        hooks.append(counting)
    return hooks


@pytest.mark.parametrize("order", ["hooks, then kernelize", "kernelize, then hooks", "hooks, kernelize, unkernelize",
                                   "kernelize, hooks, unkernelize", "hooks, kernelize twice"])
def test_diffusers_hooks_stay_around_our_forward(order):
    """Hooks on the modules kernelize replaces (the rotary module, a block, an attention)
    keep running, with our forward inside them (or the stock one after unkernelize)."""
    base = small_ltx()
    stock = copy.deepcopy(base)
    hook_everything(stock)
    expected, _ = denoising_steps(stock, steps=1)

    model = copy.deepcopy(base)
    hooks = None
    for step in steps_of(order):
        if step == "hooks":
            hooks = hook_everything(model)
        elif step == "unkernelize":
            lki.unkernelize(model)
        else:
            for _ in range(2 if step.endswith("twice") else 1):
                lki.kernelize_diffusers(model)
    actual, ops = denoising_steps(model, steps=1)

    assert [h.calls for h in hooks] == [1, 1, 1]
    assert_steps_match(actual, expected)
    unkernelized = order.endswith("unkernelize")
    assert (ops == set()) if unkernelized else (LTX_OPS <= ops)
    counts = lki.replaced_modules(model)
    assert (counts == {}) if unkernelized else (counts["LTXVideoRotaryPosEmbed"] == 1
                                                and counts["LTXVideoTransformerBlock"] == 3)
    # each hooked module: its wrapper outermost, its own forward (ours or stock) innermost
    for module in (model.rope, model.transformer_blocks[0], model.transformer_blocks[1].attn1):
        assert module.forward.func.__qualname__.startswith("HookRegistry.register_hook")


@pytest.mark.parametrize("order", ["hook, then kernelize", "kernelize, then hook", "hook, kernelize, unkernelize"])
def test_accelerate_hooks_stay_around_our_forward(order):
    """accelerate's add_hook_to_module (what dispatch_model installs for a device_map across
    GPUs) keeps running around our forward."""
    from accelerate.hooks import ModelHook as AccelerateHook
    from accelerate.hooks import add_hook_to_module

    class Count(AccelerateHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Count.calls += 1
            return args, kwargs

    stock = small_model("llama", "cpu", torch.float32)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        expected = stock(ids).logits
    model = copy.deepcopy(stock)
    norms = [model.model.norm, model.model.layers[0].input_layernorm]
    for step in steps_of(order):
        if step == "hook":
            for norm in norms:
                add_hook_to_module(norm, Count())
        elif step == "unkernelize":
            lki.unkernelize(model)
        else:
            lki.kernelize_transformers(model, mode=Mode.TRAINING)
    with torch.no_grad(), OpsCalled() as called:
        logits = model(ids).logits
    assert Count.calls == 2
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
    assert ("rms_norm" in called.names) != order.endswith("unkernelize")


def test_unknown_forward_wrappers_are_refused():
    """An instance forward kernelize cannot see into would be dropped: refused, naming the
    order that works, and the model is left as it was."""
    model = small_ltx(layers=2)
    rope = model.rope
    stock_forward = rope.forward

    def opaque(*args, **kwargs):
        return stock_forward(*args, **kwargs)

    rope.forward = opaque
    with pytest.raises(ValueError, match="kernelize the model before installing it"):
        lki.kernelize_diffusers(model)
    assert lki.replaced_modules(model) == {} and rope.forward is opaque
    assert not [m for m in model.modules() if type(m).__name__ != type(m).__qualname__.split(".")[-1]]

    del rope.forward
    lki.kernelize_diffusers(model)
    rope.forward = opaque
    with pytest.raises(ValueError, match="unkernelize before installing it"):
        lki.unkernelize(model)
    assert rope.forward is opaque and lki.replaced_modules(model)["LTXVideoTransformerBlock"] == 2
