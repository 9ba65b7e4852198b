"""FP8Linear (a linear layer as an FP8 GEMM: the weight quantized once per output channel,
the input per row by quantize_fp8 or given as a producer's FP8Rows, torch._scaled_mm)
against the fp64 GEMM of the dequantized operands, and kernelize_diffusers(fp8=True) on a
small LTX-Video transformer: what it converts, the producers that feed it, its output
against the stock model, hooks that keep it 16-bit, unkernelize, and what it refuses."""

import copy

import pytest
import torch

from test_integration_diffusers import DEVICES, flux_inputs, ltx_inputs, small_flux, small_ltx
from test_integration_transformers import lki, needs_device

BF16 = torch.bfloat16
# Relative L2 of the small LTX-Video transformer's output against stock bf16: 0.8% measured
# on the CPU (e4m3 keeps 3 mantissa bits; per-row scales); the bound leaves room for CUDA's
# GEMM, and a wrong scale gives errors of order 1.
LTX_FP8_REL_L2 = 0.03


def fp8_device(device):
    needs_device(device)
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+")


def dequantized_gemm(layer, x):
    """fp64 x_q @ w_q^T (+ bias) of the dequantized operands, and a per-element bound of
    the GEMM's accumulation error (Hopper's FP8 adds in fewer bits than fp32)."""
    q, s = lki.quantize_fp8(x.reshape(-1, layer.in_features))
    a = q.double().cpu() * s.double().cpu()
    b = layer.weight_fp8.double().cpu() * layer.weight_scale.double().cpu().t()
    want = a @ b.t()
    if layer.bias is not None:
        want = want + layer.bias.double().cpu()
    return want, 2.0**-10 * (a.abs() @ b.abs().t())


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_linear_is_the_gemm_of_its_quantized_operands(device, dtype, bias):
    fp8_device(device)
    if device == "cuda" and dtype != BF16:
        pytest.skip("CUDA's row-wise scaled GEMM writes bfloat16 (test_fp8_linear_refusals)")
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=bias).to(device=device, dtype=dtype)
    layer = lki.FP8Linear(linear)
    q, s = lki.quantize_fp8(linear.weight.detach())
    assert torch.equal(layer.weight_fp8.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale, s.reshape(1, -1))
    x = torch.randn(2, 5, 64, device=device, dtype=dtype)
    with torch.no_grad():
        y, stock = layer(x), linear(x)
    assert y.shape == (2, 5, 48) and y.dtype == dtype
    want, bound = dequantized_gemm(layer, x)
    rounding = want.abs() * (2.0**-8 if dtype == BF16 else 2.0**-22)  # the output's own rounding
    err = (y.reshape(-1, 48).double().cpu() - want).abs()
    assert bool((err <= bound + rounding).all()), f"max error {err.max().item():.2e}"
    rel = ((y.float() - stock.float()).norm() / stock.float().norm()).item()
    assert 0 < rel < 0.08, rel  # e4m3 operands: a few % of the 16-bit layer's output
    with torch.no_grad():  # views nn.Linear takes: transposed, expanded
        xt = x.reshape(10, 64).t().contiguous().t()
        assert torch.equal(layer(xt), layer(xt.contiguous()))
        xe = x[:, :1].expand(2, 5, 64)
        assert torch.equal(layer(xe), layer(xe.contiguous()))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_linear_takes_a_producers_rows(device):
    """FP8Rows a producer wrote go to the GEMM as they are: the rows quantize_fp8 makes of x
    give the layer's own result bit for bit; rows of another producer (gelu_fp8) give the
    GEMM of their dequantized values."""
    fp8_device(device)
    torch.manual_seed(0)
    layer = lki.FP8Linear(torch.nn.Linear(64, 48).to(device=device, dtype=BF16))
    x = torch.randn(2, 5, 64, device=device, dtype=BF16)
    with torch.no_grad():
        assert torch.equal(layer(lki.FP8Rows(*lki.quantize_fp8(x), BF16)), layer(x))
        q, s = lki.gelu_fp8(x, "tanh")
        y = layer(lki.FP8Rows(q, s, BF16))
    assert y.shape == (2, 5, 48) and y.dtype == BF16
    a = q.reshape(-1, 64).double().cpu() * s.reshape(-1, 1).double().cpu()
    b = layer.weight_fp8.double().cpu() * layer.weight_scale.double().cpu().t()
    want = a @ b.t() + layer.bias.double().cpu()
    err = (y.reshape(-1, 48).double().cpu() - want).abs()
    assert bool((err <= 2.0**-10 * (a.abs() @ b.abs().t()) + want.abs() * 2.0**-8).all()), err.max()
    with pytest.raises(TypeError, match=r"FP8Rows take float8_e4m3fn q \[\.\.\., 64\] and float32 scales"):
        layer(lki.FP8Rows(q, s.reshape(-1), BF16))
    with pytest.raises(ValueError, match="input of 32 features, the layer takes 64"):
        layer(lki.FP8Rows(q[..., :32], s, BF16))


def test_fp8_linear_keeps_its_dtypes_through_a_model_cast():
    layer = lki.FP8Linear(torch.nn.Linear(64, 48).to(BF16))
    x = torch.randn(3, 64, dtype=BF16)
    with torch.no_grad():
        want = layer(x)
        layer.to(torch.float16).to(BF16)
        assert layer.weight_fp8.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
        assert torch.equal(layer(x), want)


def test_fp8_linear_on_the_cpu_needs_no_rowwise_scaled_mm(monkeypatch):
    """Some torch releases' CPU torch._scaled_mm (2.11's oneDNN path) refuses row-wise scales;
    the CPU layer computes its GEMM without it, within the bound of the dequantized GEMM."""
    def per_tensor_only(a, b, scale_a, scale_b, **kwargs):
        if a.device.type == "cpu" and (scale_a.numel() != 1 or scale_b.numel() != 1):
            raise RuntimeError("Now _scaled_mm only supports per-tensor scaling for CPU backend.")
        return scaled_mm(a, b, scale_a, scale_b, **kwargs)
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", per_tensor_only)
    torch.manual_seed(0)
    layer = lki.FP8Linear(torch.nn.Linear(64, 48).to(BF16))
    x = torch.randn(2, 5, 64, dtype=BF16)
    with torch.no_grad():
        y = layer(x)
    want, bound = dequantized_gemm(layer, x)
    err = (y.reshape(-1, 48).double() - want).abs()
    assert bool((err <= bound + want.abs() * 2.0**-8).all()), err.max()


def test_fp8_linear_refusals():
    with pytest.raises(ValueError, match="multiples of 16"):
        lki.FP8Linear(torch.nn.Linear(60, 48))

    class LoraLinear(torch.nn.Linear):
        pass
    with pytest.raises(ValueError, match="LoRA-wrapped"):
        lki.FP8Linear(LoraLinear(64, 48))
    hooked = torch.nn.Linear(64, 48)
    hooked.register_forward_hook(lambda module, args, out: out)
    with pytest.raises(ValueError, match="forward hooks"):
        lki.FP8Linear(hooked)
    layer = lki.FP8Linear(torch.nn.Linear(64, 48))
    with pytest.raises(RuntimeError, match="FP8Linear is for inference"):
        layer(torch.randn(3, 64, requires_grad=True))
    with pytest.raises(ValueError, match="input of 32 features, the layer takes 64"):
        layer(torch.randn(3, 32))


def test_fp8_device_refusal(monkeypatch):
    """A CUDA device below compute capability 8.9 is refused by name (on any machine)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert lki.fp8_linear.fp8_device_refusal(torch.device("cuda", 0)) == \
        "FP8 needs a GPU of compute capability 8.9 or newer (found 8.6)"
    assert lki.fp8_linear.fp8_device_refusal(torch.device("cpu")) is None


@pytest.mark.parametrize("fused", [False, True], ids=["separate-qkv", "fused-qkv"])
@pytest.mark.parametrize("device", DEVICES)
def test_kernelize_diffusers_fp8_ltx(device, fused, monkeypatch):
    fp8_device(device)
    model = small_ltx(device, BF16)
    if fused:
        model.fuse_qkv_projections()
    stock = copy.deepcopy(model)
    inputs = ltx_inputs(device, BF16)
    counts = lki.kernelize_diffusers(model, fp8=True)
    # 2 blocks: attn1 and attn2 (q, k, v, out) and the feed-forward (2), and the fused to_qkv / to_kv
    assert counts["FP8Linear"] == 2 * (4 + 4 + 2) + (4 if fused else 0)
    assert lki.kernelize_diffusers(model, fp8=True)["FP8Linear"] == counts["FP8Linear"]  # again: the same
    fused_calls = []
    if fused:
        model.transformer_blocks[0].attn1.to_qkv.register_forward_pre_hook(lambda m, a: fused_calls.append(1))
    quantized = []  # the 16-bit inputs the FP8 linears quantize themselves
    monkeypatch.setattr(lki.fp8_linear, "quantize_fp8",
                        lambda x, _op=lki.fp8_linear.quantize_fp8: quantized.append(x.shape) or _op(x))
    assert counts["LTXVideoTransformerBlock"] == 2
    assert isinstance(model.transformer_blocks[0].attn1.to_q, lki.FP8Linear)
    assert isinstance(model.proj_out, torch.nn.Linear)  # outside the blocks: 16-bit
    with torch.no_grad():
        want = stock(**inputs, return_dict=False)[0].float()
        got = model(**inputs, return_dict=False)[0].float()
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < LTX_FP8_REL_L2, rel
    assert len(fused_calls) == (1 if fused else 0)  # the fused FP8 GEMM projected q, k, v
    # a block's attn1 output, attn2's query, its context (once for k and v, fused or not),
    # attn2's output; the rest come from the producers, but for block 0's hooked to_qkv,
    # which quantizes its own input
    assert len(quantized) == 2 * 4 + (1 if fused else 0), quantized
    lki.unkernelize(model)
    assert not any(isinstance(m, lki.FP8Linear) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(**inputs, return_dict=False)[0].float(), want)


def producer_calls(monkeypatch):
    """Counts of the FP8 producers the kernelized blocks call."""
    calls = {}
    for name in ("adaln_fp8", "gated_residual_adaln_fp8", "gelu_fp8", "geglu_fp8"):
        def counted(*args, _name=name, _op=getattr(lki.layers, name), **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _op(*args, **kwargs)
        monkeypatch.setattr(lki.layers, name, counted)
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_ltx_blocks_feed_fp8_rows_to_the_projections(device, monkeypatch):
    """Kernelized with fp8=True, each LTX block writes attn1's input with adaln_fp8 and the
    feed-forward's two inputs with gated_residual_adaln_fp8 and gelu_fp8 (tanh, LTX's
    feed-forward): the projections read FP8 rows, no 16-bit copy in between. The output
    stays within the FP8 bound of stock's, and no further from it than the path that
    quantizes each projection's 16-bit input itself (within 10%)."""
    fp8_device(device)
    model = small_ltx(device, BF16)
    stock, separate = copy.deepcopy(model), copy.deepcopy(model)
    inputs = ltx_inputs(device, BF16)
    lki.kernelize_diffusers(model, fp8=True)
    lki.convert_linears_to_fp8(separate)  # FP8 GEMMs, each quantizing its 16-bit input
    calls = producer_calls(monkeypatch)
    with torch.no_grad():
        want = stock(**inputs, return_dict=False)[0].float()
        got = model(**inputs, return_dict=False)[0].float()
        unfused = separate(**inputs, return_dict=False)[0].float()
    assert calls == {"adaln_fp8": 2, "gated_residual_adaln_fp8": 2, "gelu_fp8": 2}
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < LTX_FP8_REL_L2, rel
    rel_unfused = ((unfused - want).norm() / want.norm()).item()
    assert rel <= 1.1 * rel_unfused, (rel, rel_unfused)  # quantizing fp32 values, not their bf16 roundings


@pytest.mark.parametrize("device", DEVICES)
def test_flux_feed_forwards_write_their_gelu_as_fp8(device, monkeypatch):
    """FLUX's feed-forwards (image and text streams of its double block), kernelized with
    fp8=True, run as the FeedForward layer: the input quantized once and the GELU written by
    gelu_fp8 for the output projection. The output stays within the FP8 bound of stock's."""
    fp8_device(device)
    model = small_flux(device, BF16)
    stock = copy.deepcopy(model)
    inputs = flux_inputs(device, BF16)
    counts = lki.kernelize_diffusers(model, fp8=True)
    assert counts["FeedForward"] == 2, counts  # ff and ff_context
    calls = producer_calls(monkeypatch)
    with torch.no_grad():
        want = stock(**inputs, return_dict=False)[0].float()
        got = model(**inputs, return_dict=False)[0].float()
    assert calls == {"gelu_fp8": 2}, calls
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < LTX_FP8_REL_L2, rel
    lki.unkernelize(model)
    assert "FeedForward" not in lki.replaced_modules(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs, return_dict=False)[0].float(), want)


def test_feed_forward_layer_only_for_fp8_projections():
    """Without fp8 the feed-forwards stay stock (nothing to fuse around 16-bit GEMMs), and a
    forward another library installed on one is no concern of kernelize or unkernelize."""
    model = small_flux("cpu", BF16)
    ff = model.transformer_blocks[0].ff
    stock_forward = ff.forward

    def patched(*args, **kwargs):
        return stock_forward(*args, **kwargs)
    ff.forward = patched
    assert "FeedForward" not in lki.kernelize_diffusers(model)
    lki.unkernelize(model)
    assert ff.forward is patched


def test_a_failed_kernelize_undoes_its_own_fp8_conversions(monkeypatch):
    """A kernelize_diffusers(fp8=True) that fails (in kernelize, or while converting) leaves
    no linear of its own converted and keeps those an earlier call converted."""
    import kernels

    model = small_ltx("cpu", BF16)
    block = model.transformer_blocks[0]
    block.attn1.to_q = lki.FP8Linear(block.attn1.to_q)  # an earlier conversion
    originals = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}

    def failing_kernelize(*args, **kwargs):
        raise RuntimeError("kernelize failed")
    monkeypatch.setattr(kernels, "kernelize", failing_kernelize)
    with pytest.raises(RuntimeError, match="kernelize failed"):
        lki.kernelize_diffusers(model, fp8=True)
    monkeypatch.undo()
    assert isinstance(block.attn1.to_q, lki.FP8Linear)
    assert {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear} == originals
    assert lki.replaced_modules(model) == {}

    calls = []
    original_init = lki.FP8Linear.__init__

    def fifth_fails(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise MemoryError("out of memory")
        original_init(self, *args, **kwargs)
    monkeypatch.setattr(lki.FP8Linear, "__init__", fifth_fails)
    with pytest.raises(MemoryError):
        lki.kernelize_diffusers(model, fp8=True)
    assert {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear} == originals


@pytest.mark.parametrize("how", ["hook", "instance-forward"])
@pytest.mark.parametrize("hooked", ["attn1", "attn1.to_k", "attn1.to_qkv", "ff.net.0.proj", "ff.net.2", "ff"])
def test_hooks_keep_their_modules_16bit_inputs(hooked, how, monkeypatch):
    """Another library's hook on attn1, a projection (the fused one after
    fuse_qkv_projections) or the feed-forward, as a torch forward pre-hook or as an instance
    forward (diffusers' hook registry), sees what it would see without FP8 producers: a
    16-bit tensor, the block's producer before it not called."""
    model = small_ltx("cpu", BF16)
    if hooked == "attn1.to_qkv":
        model.fuse_qkv_projections()
    inputs = ltx_inputs("cpu", BF16)
    lki.kernelize_diffusers(model, fp8=True)
    seen = []
    module = model.transformer_blocks[0].get_submodule(hooked)
    if how == "hook":
        module.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(type(args[0] if args else kwargs["hidden_states"])), with_kwargs=True)
    else:
        original = module.forward

        def forward(*args, **kwargs):
            seen.append(type(args[0] if args else kwargs["hidden_states"]))
            return original(*args, **kwargs)
        module.forward = forward
    calls = producer_calls(monkeypatch)
    with torch.no_grad():
        model(**inputs, return_dict=False)
    assert seen == [torch.Tensor]
    attn_rows = 0 if hooked.startswith("attn1") else 1
    ff_rows = 0 if hooked.startswith("ff") else 1
    assert calls.get("adaln_fp8", 0) == 1 + attn_rows
    assert calls.get("gated_residual_adaln_fp8", 0) == 1 + ff_rows
    # a hook on the feed-forward itself has run before its FeedForward layer's forward, which
    # still writes its GELU as FP8; one inside it keeps the stock path
    assert calls.get("gelu_fp8", 0) == (2 if hooked == "ff" else 1 + ff_rows)


def test_fast_accumulation_is_the_callers_choice():
    """fp8_fast_accum reaches every converted linear (and so torch._scaled_mm); off by default."""
    for fast in (False, True):
        model = small_ltx("cpu", BF16)
        lki.kernelize_diffusers(model, fp8=True, **({"fp8_fast_accum": True} if fast else {}))
        layers = [m for m in model.modules() if isinstance(m, lki.FP8Linear)]
        assert layers and all(m.fast_accum is fast for m in layers)


def test_kernelize_diffusers_fp8_refusals():
    model = small_ltx("cpu", BF16).train()
    with pytest.raises(RuntimeError, match="training mode"):
        lki.kernelize_diffusers(model, fp8=True)
    assert lki.replaced_modules(model) == {}  # refused before anything changed

    class LoraWrapper(torch.nn.Module):  # as peft's LoRA layers: the linear inside
        def __init__(self, base_layer):
            super().__init__()
            self.base_layer = base_layer

        def forward(self, x):
            return self.base_layer(x)
    model = small_ltx("cpu", BF16)
    attn = model.transformer_blocks[1].attn2
    attn.to_v = LoraWrapper(attn.to_v)
    with pytest.raises(ValueError, match=r"attn2\.to_v: LoraWrapper is LoRA-wrapped: merge the adapters first"):
        lki.kernelize_diffusers(model, fp8=True)
    assert lki.replaced_modules(model) == {}
    assert not any(isinstance(m, lki.FP8Linear) for m in model.modules())


def test_convert_and_restore_linears_alone():
    """The conversion without kernelize: the blocks' linears but a hooked one (another
    library's forward hook stays on its 16-bit linear), back by restore_linears."""
    model = small_ltx("cpu", BF16)
    stock = copy.deepcopy(model)
    hooked = model.transformer_blocks[0].ff.net[2]
    hooked.register_forward_hook(lambda module, args, out: out)
    inputs = ltx_inputs("cpu", BF16)
    assert lki.convert_linears_to_fp8(model) == 19
    assert model.transformer_blocks[0].ff.net[2] is hooked
    with torch.no_grad():
        want = stock(**inputs, return_dict=False)[0].float()
        rel = ((model(**inputs, return_dict=False)[0].float() - want).norm() / want.norm()).item()
    assert 0 < rel < LTX_FP8_REL_L2, rel
    assert lki.restore_linears(model) == 19
    assert type(model.transformer_blocks[0].attn1.to_q) is torch.nn.Linear
    with torch.no_grad():
        assert torch.equal(model(**inputs, return_dict=False)[0].float(), want)
    with pytest.raises(ValueError, match="no attention or feed-forward linear"):
        lki.convert_linears_to_fp8(torch.nn.Sequential(torch.nn.Linear(64, 64)).eval())
