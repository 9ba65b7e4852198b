"""kernelize_diffusers (the kernel package's integration module) on small diffusers models built from their
real classes (no downloads): LTX-Video's transformer, an SD-style UNet (GEGLU), FLUX's
transformer; what is replaced (counted), what is left alone, outputs against the stock
model, the fused ops actually running, and the calls it refuses."""

import ast
import copy
import sys
from types import SimpleNamespace

import numpy
import pytest
import torch

from conftest import REPO, TARGETS
from reference import TOLERANCE
from test_integration_transformers import OpsCalled, lki, needs_device

diffusers = pytest.importorskip("diffusers", reason="requirements-dev.txt installs diffusers")
from diffusers import FluxTransformer2DModel, LTXVideoTransformer3DModel, UNet2DConditionModel  # noqa: E402
from diffusers.models.activations import GEGLU  # noqa: E402
from diffusers.models.normalization import AdaLayerNormContinuous  # noqa: E402
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm  # noqa: E402
from diffusers.models.transformers.transformer_ltx import LTXAttention, LTXVideoAttnProcessor, \
    LTXVideoRotaryPosEmbed, LTXVideoTransformerBlock  # noqa: E402

DEVICES = sorted({d for _, d in TARGETS})
DTYPES = [torch.float32, torch.bfloat16]


def randomised(model, device, dtype):
    """Random weights everywhere (zero-initialised ones too: AdaLN linears, tables)."""
    torch.manual_seed(0)
    model = model.to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 / max(p.shape[-1], 1) ** 0.5 if p.dim() > 1 else 0.1)
    return model


def assert_matches(actual, expected, dtype, scale):
    """The kernels round once where the hosts round every step in the model dtype: a few
    ulps of the output's magnitude (fp32: rounding only)."""
    atol = (1e-5 if dtype == torch.float32 else 4 * TOLERANCE[dtype]["rtol"]) * scale
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=atol)


def compare(model, inputs, dtype):
    """Stock output, kernelized output, the replacement counts and the ops that ran."""
    stock = copy.deepcopy(model)
    counts = lki.kernelize_diffusers(model)
    with torch.no_grad():
        expected = stock(**inputs, return_dict=False)[0]
        with OpsCalled() as called:
            actual = model(**inputs, return_dict=False)[0]
    assert_matches(actual, expected, dtype, expected.abs().max().item())
    return counts, called.names


# ---------------------------------------------------------------------------------------
# LTX-Video


def small_ltx(device, dtype, **config):
    model = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=16,
                                       cross_attention_dim=64, num_layers=2, caption_channels=32, **config)
    return randomised(model, device, dtype)


def ltx_inputs(device, dtype, per_token_timesteps=False):
    batch, frames, height, width, text = 2, 2, 3, 4, 7
    tokens = frames * height * width
    mask = torch.ones(batch, text, device=device)
    mask[1, 4:] = 0
    timestep = torch.randint(0, 1000, (batch, tokens) if per_token_timesteps else (batch,), device=device)
    return dict(hidden_states=torch.randn(batch, tokens, 8, device=device, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, text, 32, device=device, dtype=dtype),
                timestep=timestep, encoder_attention_mask=mask, num_frames=frames, height=height, width=width)


@pytest.mark.parametrize("per_token_timesteps", [False, True], ids=["timestep", "per-token-timesteps"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_ltx_video_transformer(device, dtype, per_token_timesteps):
    needs_device(device)
    model = small_ltx(device, dtype)
    counts, ops = compare(model, ltx_inputs(device, dtype, per_token_timesteps), dtype)
    # 2 blocks: the block, attn1 (fused prologue) and attn2 (cross-attention: its q/k norms
    # as rms_norm, the text mask as the host prepares it), norm1 and norm2, the
    # feed-forward's GELU (on CUDA a GEMM epilogue without grad, our gelu on CPU)
    assert counts == {"LTXVideoTransformerBlock": 2, "LTXAttention": 4, "DiffusersRMSNorm": 4, "DiffusersGELU": 2,
                      "LTXVideoRotaryPosEmbed": 1}
    assert {"adaln", "gated_residual", "gated_residual_adaln", "qk_norm_rope", "rms_norm"} <= ops
    assert ("gelu" in ops) == (device == "cpu" or dtype == torch.float32)


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped-projections"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_ltx_fused_qkv_projections(device, dtype, wrapped):
    """After diffusers' fuse_qkv_projections(), the kernelized self-attention projects
    through to_qkv and hands q and k to qk_norm_rope as strided views of that one output;
    cross-attention, marked as such (diffusers then builds to_kv), projects k and v
    through to_kv. The stock processor keeps calling the separate projections: it is the
    reference. Separate projections with a forward hook (as LoRA or offload wrappers
    work) are called instead of the fused copies."""
    needs_device(device)
    model = small_ltx(device, dtype)
    for block in model.transformer_blocks:
        block.attn2.is_cross_attention = True  # LTX does not set it: diffusers would build to_qkv
    model.fuse_qkv_projections()
    called = {("attn1", "to_qkv"): 0, ("attn2", "to_kv"): 0}
    for block in model.transformer_blocks:
        for attn, name in called:
            getattr(getattr(block, attn), name).register_forward_hook(
                lambda *_, key=(attn, name): called.__setitem__(key, called[key] + 1))
        if wrapped:
            block.attn1.to_q.register_forward_hook(lambda module, args, out: out)
            block.attn2.to_k.register_forward_hook(lambda module, args, out: out)
    counts, ops = compare(model, ltx_inputs(device, dtype), dtype)
    assert counts["LTXAttention"] == 4 and {"qk_norm_rope", "rms_norm"} <= ops
    # 2 blocks, kernelized (the stock copy never calls the fused modules)
    assert called == {("attn1", "to_qkv"): 0 if wrapped else 2, ("attn2", "to_kv"): 0 if wrapped else 2}


def test_ltx_fused_projections_only_without_grad():
    """Frozen weights but a text context that records grad: cross-attention keeps the
    separate projections (the fused copies are for inference), and the context's grad
    matches the stock model's."""
    model = small_ltx("cpu", torch.float32)
    for block in model.transformer_blocks:
        block.attn2.is_cross_attention = True
    model.fuse_qkv_projections()
    model.requires_grad_(False)  # the fused copies too
    stock = copy.deepcopy(model)
    lki.kernelize_diffusers(model)
    to_kv_calls = []
    for block in model.transformer_blocks:
        block.attn2.to_kv.register_forward_hook(lambda *_: to_kv_calls.append(1))
    inputs, grads = ltx_inputs("cpu", torch.float32), []
    for m in (stock, model):
        context = inputs["encoder_hidden_states"].detach().requires_grad_()
        m(**dict(inputs, encoder_hidden_states=context), return_dict=False)[0].square().sum().backward()
        grads.append(context.grad)
    assert to_kv_calls == []
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_ltx_rotary_tables_computed_once_for_the_batch(device):
    """The kernelized LTXVideoRotaryPosEmbed returns the stock tables bit for bit; without
    video_coords (and with scalar interpolation scales) as one entry's tables expanded over
    the batch, else the host's per-entry tables."""
    needs_device(device)
    model = small_ltx(device, torch.float32)
    stock = copy.deepcopy(model)
    assert lki.kernelize_diffusers(model)["LTXVideoRotaryPosEmbed"] == 1
    batch, frames, height, width = 3, 2, 3, 4
    x = torch.randn(batch, frames * height * width, 8, device=device)
    grid = dict(num_frames=frames, height=height, width=width)
    coords = torch.rand(batch, 3, frames * height * width, device=device) * 10
    cases = {
        "no scale": (dict(grid), True),
        "scalar scales": (dict(grid, rope_interpolation_scale=(torch.tensor(0.32, device=device), 32 / 25, 32.0)),
                          True),
        "one-element tensor scales": (dict(grid, rope_interpolation_scale=torch.tensor([0.32, 1.28, 32.0],
                                                                                        device=device)), True),
        "per-entry scale": (dict(grid, rope_interpolation_scale=(
            torch.tensor([0.2, 0.3, 0.4], device=device).view(batch, 1, 1, 1, 1), 1.0, 1.0)), False),
        "video_coords": (dict(video_coords=coords), False),
    }
    if device == "cpu":  # the stock module on CUDA fails on it too (numpy converts the grid)
        cases["per-entry scale, not a tensor"] = (dict(grid, rope_interpolation_scale=(
            numpy.array([0.2, 0.3, 0.4], dtype=numpy.float32).reshape(batch, 1, 1, 1, 1), 1.0, 1.0)), False)
    for case, (kwargs, expanded) in cases.items():
        with torch.no_grad():
            expected, actual = stock.rope(x, **kwargs), model.rope(x, **kwargs)
        for e, a in zip(expected, actual):
            assert a.shape == e.shape and torch.equal(a, e), case
            assert (a.stride(0) == 0) == expanded, case


def test_ltx_rotary_subclass_with_its_own_grid_is_left_alone():
    """A subclass whose grid may differ per batch entry keeps its own forward."""
    from diffusers.models.transformers.transformer_ltx import LTXVideoRotaryPosEmbed

    class ShiftedRope(LTXVideoRotaryPosEmbed):
        def _prepare_video_coords(self, batch_size, *args, **kwargs):
            grid = super()._prepare_video_coords(batch_size, *args, **kwargs)
            return grid + torch.arange(batch_size, dtype=grid.dtype, device=grid.device).view(-1, 1, 1)

    model = small_ltx("cpu", torch.float32)
    stock_rope = model.rope
    model.rope = ShiftedRope(stock_rope.dim, stock_rope.base_num_frames, stock_rope.base_height,
                             stock_rope.base_width, stock_rope.patch_size, stock_rope.patch_size_t, stock_rope.theta)
    counts = lki.kernelize_diffusers(model)
    assert "LTXVideoRotaryPosEmbed" not in counts and type(model.rope) is ShiftedRope
    assert "forward" not in vars(model.rope)
    cos, _ = model.rope(torch.randn(2, 24, 8), num_frames=2, height=3, width=4)
    assert not torch.equal(cos[0], cos[1])


def test_ltx_unsupported_configurations_are_left_alone():
    """Affine block norms (the block is not fused; its RMSNorms are) and a custom attention
    processor (that attention keeps its stock forward)."""
    model = small_ltx("cpu", torch.float32, norm_elementwise_affine=True)

    class CustomProcessor(LTXVideoAttnProcessor):
        pass

    custom = model.transformer_blocks[0].attn1
    custom.set_processor(CustomProcessor())
    counts, ops = compare(model, ltx_inputs("cpu", torch.float32), torch.float32)
    assert counts == {"LTXAttention": 3, "DiffusersRMSNorm": 4, "DiffusersGELU": 2, "LTXVideoRotaryPosEmbed": 1}
    assert type(custom) is LTXAttention and type(model.transformer_blocks[0]) is LTXVideoTransformerBlock
    assert "forward" not in vars(custom) and "forward" not in vars(model.transformer_blocks[0])
    assert {"rms_norm", "qk_norm_rope"} <= ops and "adaln" not in ops


# ---------------------------------------------------------------------------------------
# SD-style UNet (GEGLU feed-forwards)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_sd_unet_geglu(device, dtype):
    needs_device(device)
    model = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
    model = randomised(model, device, dtype)
    inputs = dict(sample=torch.randn(2, 4, 8, 8, device=device, dtype=dtype),
                  timestep=torch.tensor([10, 500], device=device),
                  encoder_hidden_states=torch.randn(2, 5, 32, device=device, dtype=dtype))
    counts, ops = compare(model, inputs, dtype)
    # transformer blocks: 1 down, 1 mid, 2 up (layers_per_block + 1)
    assert counts == {"GEGLU": 4} == {"GEGLU": sum(isinstance(m, GEGLU) for m in model.modules())}
    # fp32 on the CPU: the layer runs the stock code
    assert ops == (set() if device == "cpu" and dtype == torch.float32 else {"geglu"})


# ---------------------------------------------------------------------------------------
# FLUX


def small_flux(device, dtype):
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                   axes_dims_rope=(4, 6, 6))
    return randomised(model, device, dtype)


def flux_inputs(device, dtype):
    batch, tokens, text = 2, 12, 5
    return dict(hidden_states=torch.randn(batch, tokens, 8, device=device, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, text, 32, device=device, dtype=dtype),
                pooled_projections=torch.randn(batch, 32, device=device, dtype=dtype),
                timestep=torch.tensor([0.3, 0.9], device=device, dtype=dtype),
                img_ids=torch.randint(0, 4, (tokens, 3), device=device).float(),
                txt_ids=torch.zeros(text, 3, device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_flux_transformer(device, dtype):
    needs_device(device)
    counts, ops = compare(small_flux(device, dtype), flux_inputs(device, dtype), dtype)
    # the double block's norm1 and norm1_context, the single block's norm, the final norm_out;
    # the double block's ff and ff_context GELUs (a GEMM epilogue on CUDA in 16 bits)
    assert counts == {"AdaLayerNormZero": 2, "AdaLayerNormZeroSingle": 1, "AdaLayerNormContinuous": 1,
                      "DiffusersGELU": 2}
    assert ops == ({"adaln", "gelu"} if device == "cpu" or dtype == torch.float32 else {"adaln"})


# ---------------------------------------------------------------------------------------
# Single layers and fallbacks


@pytest.mark.parametrize("weight", ["bf16", "fp32", "none", "fp16-weight-bf16-input"])
def test_diffusers_rmsnorm_layer(weight):
    """Each weight dtype gives the host's output dtype and values; a weight the kernel does
    not pair with the input goes to the host (no op runs)."""
    norm = DiffusersRMSNorm(64, eps=1e-6, elementwise_affine=weight != "none")
    if norm.weight is not None:
        norm = randomised(norm, "cpu", {"bf16": torch.bfloat16, "fp32": torch.float32}.get(weight, torch.float16))
    model = torch.nn.Sequential(norm)
    stock = copy.deepcopy(model)
    assert lki.kernelize_diffusers(model, device="cpu") == {"DiffusersRMSNorm": 1}  # no weight to tell
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    with OpsCalled() as called:
        actual = model(x)
    expected = stock(x)
    assert actual.dtype == expected.dtype
    assert_matches(actual, expected, torch.bfloat16, expected.abs().max().item())
    assert called.names == (set() if weight.startswith("fp16") else {"rms_norm"})


def module_hook_guards(compiled_code) -> list:
    """The guards of dynamo's compiled ``compiled_code`` that read a module's hook dicts."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(compiled_code)
    assert len(entries) == 1
    return [part for part in entries[0].guard_manager.code_parts if "L['self']" in part and "_hooks" in part]


def test_layers_run_from_subclasses_without_hook_guards():
    """kernelize_diffusers leaves no per-instance forward: each replaced module runs its
    layer from a subclass of its class, which dynamo calls without guarding the module's
    hook dicts (four per module with a per-instance forward); unkernelize and a second
    kernelize put the classes back and take them again."""
    model = small_ltx("cpu", torch.float32)
    counts = lki.kernelize_diffusers(model)
    block = model.transformer_blocks[0]
    assert not [m for m in model.modules() if "forward" in vars(m)]
    assert isinstance(block, LTXVideoTransformerBlock) and type(block) is not LTXVideoTransformerBlock
    assert type(block).__name__ == "LTXVideoTransformerBlock"
    assert model.state_dict().keys() == small_ltx("cpu", torch.float32).state_dict().keys()

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
    with torch.no_grad():
        compiled(**ltx_inputs("cpu", torch.float32), return_dict=False)
    assert module_hook_guards(type(model).forward.__code__) == []
    torch._dynamo.reset()

    assert lki.kernelize_diffusers(model) == counts and type(model.transformer_blocks[0]) is type(block)
    lki.unkernelize(model)
    assert type(block) is LTXVideoTransformerBlock and lki.replaced_modules(model) == {}
    assert not [m for m in model.modules() if "forward" in vars(m)]


class _Identity(torch.nn.Module):
    def forward(self, value):
        return value


def test_layer_subclasses_stay_out_of_other_libraries_classes():
    """A class another library derives for one instance (parametrize here; FSDP does the
    same) keeps kernelize's per-instance forward when it comes first, and when it comes
    after, counts and unkernelize still see through it."""
    import torch.nn.utils.parametrize as parametrize

    inputs = ltx_inputs("cpu", torch.float32)
    model = small_ltx("cpu", torch.float32)
    stock = copy.deepcopy(model)
    parametrize.register_parametrization(model.transformer_blocks[0], "scale_shift_table", _Identity())
    counts = lki.kernelize_diffusers(model)
    assert counts["LTXVideoTransformerBlock"] == 2 and "forward" in vars(model.transformer_blocks[0])
    parametrize.remove_parametrizations(model.transformer_blocks[0], "scale_shift_table", leave_parametrized=True)
    with torch.no_grad():
        assert_matches(model(**inputs, return_dict=False)[0], stock(**inputs, return_dict=False)[0], torch.float32, 1)

    model = small_ltx("cpu", torch.float32)
    assert lki.kernelize_diffusers(model) == counts
    parametrize.register_parametrization(model.transformer_blocks[0], "scale_shift_table", _Identity())
    assert lki.replaced_modules(model) == counts
    lki.unkernelize(model)
    assert lki.replaced_modules(model) == {}
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs, return_dict=False)[0], stock(**inputs, return_dict=False)[0],
                                   rtol=0, atol=0)


def test_layers_without_host_lookup_keep_instance_forwards(monkeypatch):
    """Layers of an older build call ``type(self).forward`` for the host, which on a layer
    subclass would be themselves: their forwards stay on the instances."""
    model = small_ltx("cpu", torch.float32)
    counts = lki.kernelize_diffusers(model)
    layers = sys.modules[type(model.rope).forward.__module__]
    monkeypatch.delattr(layers, "_host")
    assert lki.kernelize_diffusers(model) == counts
    assert type(model.rope) is LTXVideoRotaryPosEmbed and "forward" in vars(model.rope)
    assert not [m for m in model.modules() if "_ltx_host" in vars(type(m))]


def test_hooks_on_modules_left_alone_survive():
    """kernelize_diffusers takes back only its own subclasses before kernelizing: a
    diffusers hook on a module no layer replaces still runs."""
    from diffusers.hooks import HookRegistry, ModelHook

    class CountCalls(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            CountCalls.calls += 1
            return args, kwargs

    class CustomProcessor(LTXVideoAttnProcessor):
        pass

    model = small_ltx("cpu", torch.float32)
    attention = model.transformer_blocks[0].attn1
    attention.set_processor(CustomProcessor())
    HookRegistry.check_if_exists_or_initialize(attention).register_hook(CountCalls(), "count")
    lki.kernelize_diffusers(model)
    with torch.no_grad():
        model(**ltx_inputs("cpu", torch.float32), return_dict=False)
    assert CountCalls.calls == 1


def test_unsupported_diffusers_modules_are_left_alone():
    affine = AdaLayerNormContinuous(32, 32, elementwise_affine=True, eps=1e-6)
    with_bias = DiffusersRMSNorm(32, eps=1e-6, bias=True)
    fused = AdaLayerNormContinuous(32, 32, elementwise_affine=False, eps=1e-6)
    model = torch.nn.ModuleList([affine, with_bias, fused])
    assert lki.kernelize_diffusers(model) == {"AdaLayerNormContinuous": 1}
    assert type(affine) is AdaLayerNormContinuous and type(with_bias) is DiffusersRMSNorm
    assert type(fused) is not AdaLayerNormContinuous and isinstance(fused, AdaLayerNormContinuous)
    assert not [m for m in model if "forward" in vars(m)]


def test_pipeline_components_are_kernelized():
    transformer, unet_like = small_flux("cpu", torch.float32), torch.nn.Sequential(GEGLU(8, 8))
    pipeline = SimpleNamespace(components={"transformer": transformer, "unet": unet_like, "scheduler": object()})
    assert lki.kernelize_diffusers(pipeline) == {"AdaLayerNormZero": 2, "AdaLayerNormZeroSingle": 1,
                                                 "AdaLayerNormContinuous": 1, "DiffusersGELU": 2, "GEGLU": 1}


def test_refuses_pipelines_not_ready():
    model = small_ltx("cpu", torch.float32)
    model.enable_group_offload(onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1)
    with pytest.raises(ValueError, match="before enable_model_cpu_offload"):
        lki.kernelize_diffusers(model)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"call \.to\('cuda'\)"):
            lki.kernelize_diffusers(small_ltx("cpu", torch.float32), device="cuda")
    with pytest.raises(ValueError, match="none of the components"):
        lki.kernelize_diffusers(SimpleNamespace(components={"vae": torch.nn.Linear(2, 2)}))
    with pytest.raises(ValueError, match="no module ltx-kernels replaces"):
        lki.kernelize_diffusers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="diffusers pipeline or model"):
        lki.kernelize_diffusers("Lightricks/LTX-Video")


def test_the_kernel_package_imports_the_libraries_it_integrates_lazily():
    """The kernel package imports only stdlib and torch when it is imported: kernels,
    transformers and diffusers only inside the integration's functions."""
    for path in (REPO / "torch-ext" / "ltx_kernels").glob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module-level statements only
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert not [n for n in names if n.split(".")[0] in ("diffusers", "transformers", "kernels")], \
                    (path.name, names)
