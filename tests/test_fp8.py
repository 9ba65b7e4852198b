"""The FP8 producers (quantize_fp8, rms_norm_fp8, adaln_fp8, gated_residual_adaln_fp8, gelu_fp8,
gelu_mul_fp8, geglu_fp8): q and scales bit for bit against a PyTorch
quantizer applied to the op's fp32 result, the dequantized rows within one e4m3 step of an
fp64 path, edge rows, static scales, torch._scaled_mm on the outputs, refusals, and the fake
implementations under torch.compile."""

import pytest
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn
# (rows, D): widths of one element, odd, one vector, long; many rows; 3-D below. The last two
# take the CUDA norms' wide rows in fp32 (eight vectors a thread; staged in shared memory).
SHAPES = [(5, 1), (9, 7), (4, 8), (33, 1000), (3, 4096), (2, 16384), (3000, 8), (300, 12288), (2, 40960)]


@pytest.fixture
def fp8_device(kernel, device):
    """The device, where it takes FP8 (CUDA: compute capability 8.9 or newer)."""
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+ (test_refuses_gpus_before_sm89 covers this GPU)")
    return device


def reference_quantize(y: torch.Tensor, scale=None):
    """The quantizer in PyTorch: fp32 y, per-row scales (or the static one) and e4m3 q. On
    the CPU: CUDA's division by a Python number multiplies by its reciprocal (amax * (1/448)
    is an ulp off amax / 448 for some amax)."""
    y = y.cpu()
    scale = scale.cpu() if isinstance(scale, torch.Tensor) else scale
    if scale is None:
        amax = y.abs().amax(-1, keepdim=True) if y.shape[-1] else torch.zeros_like(y[..., :1])
        scale = amax.clamp(min=1e-12) / E4M3_MAX
    return (y / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def assert_bits(got, want):
    """Equal values, NaN where NaN (as floats: NaN's sign bit is no value)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=0, atol=0, equal_nan=True)


def assert_quantizes(q, scales, y):
    """(q, scales) are reference_quantize's of the fp32 rows y, bit for bit."""
    want_q, want_scales = reference_quantize(y)
    assert_bits(q, want_q)
    assert_bits(scales, want_scales)


def e4m3_step(m: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values around |m| (subnormals below 2^-6: 2^-9)."""
    exponent = torch.floor(torch.log2(m.abs().clamp(min=2.0**-6)))
    return torch.pow(2.0, exponent - 3)


def assert_within_one_step(q, scales, y64):
    """q * scale within one e4m3 step (in scaled units) of the fp64 row y64."""
    scales = scales.double().cpu()
    want = (y64.cpu() / scales).clamp(-E4M3_MAX, E4M3_MAX)
    err = (q.double().cpu() - want).abs()
    assert bool((err <= e4m3_step(want)).all()), f"max error {err.max().item()} (in e4m3 units of the scale)"


def rms64(x, weight, eps, weight_offset, cast_before_weight):
    """RMSNorm in fp64 (cast_before_weight: the normed value rounded to x's dtype first)."""
    x64 = x.double()
    n = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        n = n.to(x.dtype).double()
    return n if weight is None else n * (weight_offset + weight.double())


def rms_fp32(kernel, x, weight, eps, weight_offset, cast_before_weight):
    """What rms_norm(..., out_dtype=float32) returns: an fp32 weight (ones for none: times 1
    changes no bit) beside 16-bit x."""
    w = weight
    if x.dtype != torch.float32:
        w = torch.ones(x.shape[-1], device=x.device) if weight is None else weight.float()
    return kernel.rms_norm(x, w, eps, weight_offset=weight_offset, cast_before_weight=cast_before_weight,
                           out_dtype=torch.float32)


def make(shape, dtype, device, scale=2.0):
    return (torch.randn(shape) * scale).to(device=device, dtype=dtype)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_fp8(kernel, fp8_device, shape, dtype):
    x = make(shape, dtype, fp8_device)
    q, scales = kernel.quantize_fp8(x)
    assert q.is_contiguous() and scales.dtype == torch.float32 and scales.shape == (*shape[:-1], 1)
    assert_quantizes(q, scales, x.float())
    assert_within_one_step(q, scales, x.double())


@pytest.mark.kernels_ci
@pytest.mark.parametrize("cast_before_weight", [False, True])
@pytest.mark.parametrize("weight", ["none", "dtype", "fp32", "offset"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_fp8(kernel, fp8_device, shape, dtype, weight, cast_before_weight):
    check_rms_norm_fp8(kernel, fp8_device, shape, dtype, weight, cast_before_weight)


def check_rms_norm_fp8(kernel, device, shape, dtype, weight, cast_before_weight):
    """q and scales quantize the fp32 output's y bit for bit, within one e4m3 step of fp64;
    weight: none, of x's dtype, fp32, or of x's dtype under weight_offset 1."""
    x = make(shape, dtype, device)
    w_dtype = torch.float32 if weight == "fp32" else dtype
    w = None if weight == "none" else (1.0 + 0.5 * torch.randn(shape[-1])).to(device=device, dtype=w_dtype)
    offset = 1.0 if weight == "offset" else 0.0
    if weight == "offset":
        w = w - 1.0
    q, scales = kernel.rms_norm_fp8(x, w, 1e-6, weight_offset=offset, cast_before_weight=cast_before_weight)
    y = rms_fp32(kernel, x, w, 1e-6, offset, cast_before_weight)
    assert_quantizes(q, scales, y)
    assert_within_one_step(q, scales, rms64(x, w, 1e-6, offset, cast_before_weight))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_fp8_without_weight_takes_no_offset(kernel, fp8_device, dtype):
    """Without a weight there is nothing to offset, as in rms_norm: weight_offset changes no
    bit, for 16-bit input as for fp32."""
    x = make((6, 256), dtype, fp8_device)
    want_q, want_scales = reference_quantize(rms_fp32(kernel, x, None, 1e-6, 0.0, False))
    for offset in (0.0, 1.0):
        q, scales = kernel.rms_norm_fp8(x, None, 1e-6, weight_offset=offset)
        assert_bits(q, want_q)
        assert_bits(scales, want_scales)


# Widths, in 16-byte vectors a row, at which the fp32 output's CUDA launch spreads a row
# over several warps once a batch has 64 rows an SM or more (four vectors a thread on two
# warps (256, 225) or four (512, 375); after a residual add, one on eight or four on four;
# 2048 and 4096 are LTX-Video 2B's and 13B's widths): the FP8 output sums as that launch does.
MANY_ROWS_VECS = [256, 225, 512, 375]


def many_rows(device, vecs, dtype):
    """(rows, cols): more rows than 64 an SM, not a whole number of blocks, each of `vecs`
    16-byte vectors of dtype."""
    rows = 64 * torch.cuda.get_device_properties(device).multi_processor_count + 3
    return rows, vecs * 16 // (torch.finfo(dtype).bits // 8)


@pytest.mark.parametrize("cast_before_weight", [False, True])
@pytest.mark.parametrize("weight", ["none", "dtype", "fp32", "offset"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vecs", MANY_ROWS_VECS)
def test_rms_norm_fp8_many_rows(kernel, fp8_device, vecs, dtype, weight, cast_before_weight):
    """q and scales quantize the fp32 output's y bit for bit at the CUDA launch of many rows
    (the CPU twin's rows take one path at any count: SHAPES covers it)."""
    if fp8_device != "cuda":
        pytest.skip("a CUDA launch")
    check_rms_norm_fp8(kernel, fp8_device, many_rows(fp8_device, vecs, dtype), dtype, weight, cast_before_weight)


# The modulation of test_adaln_fp8_many_rows: per batch entry (entries of tokens not a
# multiple of 8, and of a multiple of 8, where the CUDA launch's blocks of rows each lie in one entry
# and share its scale and shift), one for every row, per token.
MANY_ROWS_MODULATIONS = ["entry", "entry-tokens-8k", "shared", "token"]


@pytest.mark.parametrize("modulation", MANY_ROWS_MODULATIONS)
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vecs", MANY_ROWS_VECS)
def test_adaln_fp8_many_rows(kernel, fp8_device, vecs, dtype, norm, modulation):
    """adaln_fp8 at the CUDA launch of many rows: fp32 rows quantize adaln's own fp32 output
    bit for bit, with the dynamic scales and a static one; every dtype within one e4m3 step
    of fp64."""
    if fp8_device != "cuda":
        pytest.skip("a CUDA launch")
    rows, cols = many_rows(fp8_device, vecs, dtype)
    tokens = -(-rows // 3)  # three batch entries
    if modulation == "entry-tokens-8k":
        tokens = -(-tokens // 8) * 8
    elif tokens % 8 == 0:
        tokens += 1
    x = make((3, tokens, cols), dtype, fp8_device) + 0.5
    mod_shape = {"entry": (3, 1, cols), "entry-tokens-8k": (3, 1, cols), "shared": (1, 1, cols),
                 "token": (3, tokens, cols)}[modulation]
    scale, shift = make(mod_shape, dtype, fp8_device, 0.3), make(mod_shape, dtype, fp8_device, 0.3)
    q, scales = kernel.adaln_fp8(x, scale, shift, 1e-6, norm=norm)
    assert_within_one_step(q, scales, adaln64(x, scale, shift, 1e-6, norm))
    y = adaln_fp32(kernel, fp8_device, dtype, x, scale, shift, 1e-6, norm)
    if y is not None:
        assert_quantizes(q, scales, y)
        fixed = torch.tensor([0.01], device=fp8_device)
        assert_bits(kernel.adaln_fp8(x, scale, shift, 1e-6, norm=norm, fp8_scale=fixed)[0],
                    reference_quantize(y, fixed)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_many_rows_non_finite_and_static(kernel, fp8_device, dtype):
    """At the CUDA launch of many rows of 256 16-byte vectors (the warp-a-row kernel, its
    weight and modulation staged), rows holding an inf or a NaN beside finite rows (their
    quotient is not Markstein's step) and a static scale: the bits of the fp32 output's y."""
    if fp8_device != "cuda":
        pytest.skip("a CUDA launch")
    rows, cols = many_rows(fp8_device, 256, dtype)
    x = make((rows, cols), dtype, fp8_device)
    x[1, 7], x[2, 3] = float("inf"), float("nan")
    w = (1.0 + 0.5 * torch.randn(cols)).to(device=fp8_device, dtype=torch.float32)
    y = rms_fp32(kernel, x, w, 1e-6, 0.0, False)
    assert_quantizes(*kernel.rms_norm_fp8(x, w, 1e-6), y)
    fixed = torch.tensor([0.01], device=fp8_device)
    assert_bits(kernel.rms_norm_fp8(x, w, 1e-6, scale=fixed)[0], reference_quantize(y, fixed)[0])
    tokens = -(-rows // 24) * 8  # three batch entries, each a whole number of the launch's blocks
    h = make((3, tokens, cols), dtype, fp8_device) + 0.5
    h[0, 1, 7], h[1, 2, 3] = float("inf"), float("nan")
    scale, shift = make((3, 1, cols), dtype, fp8_device, 0.3), make((3, 1, cols), dtype, fp8_device, 0.3)
    y = adaln_fp32(kernel, fp8_device, dtype, h, scale, shift, 1e-6, "rms")
    if y is not None:  # fp32 rows: adaln's own fp32 output
        assert_quantizes(*kernel.adaln_fp8(h, scale, shift, 1e-6, norm="rms"), y)
        assert_bits(kernel.adaln_fp8(h, scale, shift, 1e-6, norm="rms", fp8_scale=fixed)[0],
                    reference_quantize(y, fixed)[0])
    else:  # the non-finite rows' scales and bytes
        q, scales = kernel.adaln_fp8(h, scale, shift, 1e-6, norm="rms")
        assert scales[0, 1].isnan().all() and scales[1, 2].isnan().all() and scales[2].isfinite().all()


def adaln64(h, scale, shift, eps, norm):
    """AdaLN in fp64: norm(h) * (1 + scale) + shift."""
    h64 = h.double()
    mean = h64.mean(-1, keepdim=True) if norm == "layer" else torch.zeros_like(h64[..., :1])
    centred = h64 - mean
    return centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps) * (1 + scale.double()) + shift.double()


def adaln_fp32(kernel, device, dtype, h, scale, shift, eps, norm):
    """adaln's y before its rounding to h's dtype, where it is defined bit for bit: adaln of fp32
    rows is it (the same launch on CUDA); on the CPU, whose twin converts 16-bit rows to fp32
    and sums them in the same order, adaln of the rows in fp32 is it too. None for 16-bit rows
    on CUDA (adaln has no fp32 output; the fp64 comparison covers them)."""
    if dtype != torch.float32 and device != "cpu":
        return None
    return kernel.adaln(h.float(), scale.float(), shift.float(), eps, norm=norm)


# x sizes and the modulation's: per batch entry, shared by all rows, per token; 2-D input.
ADALN_CASES = [((2, 7, 64), (2, 1, 64)), ((3, 40, 1024), (1024,)), ((2, 5, 96), (2, 5, 96)), ((9, 256), (9, 256))]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ADALN_CASES, ids=str)
def test_adaln_fp8(kernel, fp8_device, case, dtype, norm):
    check_adaln_fp8(kernel, fp8_device, *case, dtype, norm)


def check_adaln_fp8(kernel, device, x_shape, mod_shape, dtype, norm):
    """q and scales quantize adaln's y in fp32 (where it is defined bit for bit, adaln_fp32),
    within one e4m3 step of fp64 everywhere; a static scale is returned as given."""
    x = make(x_shape, dtype, device) + 0.5
    scale, shift = make(mod_shape, dtype, device, 0.3), make(mod_shape, dtype, device, 0.3)
    q, scales = kernel.adaln_fp8(x, scale, shift, 1e-6, norm=norm)
    assert q.dtype == FP8 and q.is_contiguous() and q.shape == x.shape and scales.shape == (*x.shape[:-1], 1)
    y = adaln_fp32(kernel, device, dtype, x, scale, shift, 1e-6, norm)
    if y is not None:
        assert_quantizes(q, scales, y)
    assert_within_one_step(q, scales, adaln64(x, scale, shift, 1e-6, norm))
    fixed = torch.tensor([0.01], device=device)
    q_static, s = kernel.adaln_fp8(x, scale, shift, 1e-6, norm=norm, fp8_scale=fixed)
    assert s is fixed
    if y is not None:
        assert_bits(q_static, reference_quantize(y, fixed)[0])


def test_adaln_fp8_refusals(kernel, fp8_device):
    x = make((2, 3, 32), torch.bfloat16, fp8_device)
    mod = make((2, 1, 32), torch.bfloat16, fp8_device)
    with pytest.raises(RuntimeError, match=r"adaln_fp8: input has dtype Double; expected float32"):
        kernel.ops.adaln_fp8(x.double(), mod.double(), mod.double(), 1e-6, "rms")
    with pytest.raises(RuntimeError, match=r"adaln_fp8: norm must be \"rms\" or \"layer\""):
        kernel.ops.adaln_fp8(x, mod, mod, 1e-6, "batch")
    with pytest.raises(RuntimeError, match=r"adaln_fp8: shift has dtype Float but input has dtype"):
        kernel.adaln_fp8(x, mod, mod.float())
    with pytest.raises(RuntimeError, match=r"adaln_fp8_static: fp8_scale must be a float32 tensor of one element"):
        kernel.adaln_fp8(x, mod, mod, fp8_scale=torch.ones(2, device=fp8_device))
    with pytest.raises(RuntimeError, match=r"adaln_fp8: scale requires grad, but FP8 outputs"):
        kernel.adaln_fp8(x, mod.clone().requires_grad_(), mod)


# The adaln cases, and LTX-Video's width at enough rows for the CUDA launch of one vector a
# thread (two rows or more an SM).
GATED_CASES = ADALN_CASES + [((2, 300, 2048), (2, 1, 2048))]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GATED_CASES, ids=str)
def test_gated_residual_adaln_fp8(kernel, fp8_device, case, dtype, norm):
    check_gated_residual_adaln_fp8(kernel, fp8_device, *case, dtype, norm)


def check_gated_residual_adaln_fp8(kernel, device, x_shape, mod_shape, dtype, norm):
    """h is gated_residual_adaln's sum bit for bit; q and scales quantize the AdaLN of h in
    fp32: gated_residual_adaln's own output for fp32 rows (an fp32 rounding changes no bit),
    adaln of h in fp32 on the CPU (its twin normalises the rounded sum so), and within one
    e4m3 step of fp64 everywhere."""
    residual, x = make(x_shape, dtype, device) + 0.5, make(x_shape, dtype, device)
    gate, scale, shift = (make(mod_shape, dtype, device, 0.3) for _ in range(3))
    h, q, scales = kernel.gated_residual_adaln_fp8(residual, x, gate, scale, shift, 1e-6, norm=norm)
    want_h, out = kernel.gated_residual_adaln(residual, x, gate, scale, shift, 1e-6, norm=norm)
    assert_bits(h, want_h)
    assert q.dtype == FP8 and q.is_contiguous() and q.shape == x.shape and scales.shape == (*x.shape[:-1], 1)
    y = out if dtype == torch.float32 else adaln_fp32(kernel, device, dtype, h, scale, shift, 1e-6, norm)
    if y is not None:
        assert_quantizes(q, scales, y)
    assert_within_one_step(q, scales, adaln64(h, scale, shift, 1e-6, norm))
    fixed = torch.tensor([0.01], device=device)
    h_static, q_static, s = kernel.gated_residual_adaln_fp8(residual, x, gate, scale, shift, 1e-6, norm=norm,
                                                            fp8_scale=fixed)
    assert s is fixed
    assert_bits(h_static, want_h)
    if y is not None:
        assert_bits(q_static, reference_quantize(y, fixed)[0])


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("op", ["adaln_fp8", "gated_residual_adaln_fp8"])
@pytest.mark.parametrize("d", [16000, 16384])
def test_fp32_decode_rows_fp8(kernel, fp8_device, op, norm, d):
    """fp32 decode rows of 16000 and 16384 (eight vectors a thread of 512 on CUDA, threads
    416-511 without an eighth at 16000, y made again for the write; after the gated residual
    with every vector's loads first): the quantized fp32 output bit for bit."""
    check = check_adaln_fp8 if op == "adaln_fp8" else check_gated_residual_adaln_fp8
    check(kernel, fp8_device, (2, 1, d), (2, 1, d), torch.float32, norm)


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vecs", MANY_ROWS_VECS)
def test_gated_residual_adaln_fp8_many_rows(kernel, fp8_device, vecs, dtype, norm):
    """gated_residual_adaln_fp8 at the CUDA launch of many rows (after a residual add, rows of
    at most 256 vectors take one a thread: eight warps at 2048 in 16 bits)."""
    if fp8_device != "cuda":
        pytest.skip("a CUDA launch")
    rows, cols = many_rows(fp8_device, vecs, dtype)
    tokens = -(-rows // 3)  # three batch entries
    check_gated_residual_adaln_fp8(kernel, fp8_device, (3, tokens, cols), (3, 1, cols), dtype, norm)


def gelu64(x, approximate):
    """GELU in fp64."""
    x = x.double()
    return torch.nn.functional.gelu(x, approximate=approximate)


# (form, x's shape): the forms' own last dims (geglu's rows are half of x's), a long row (the
# CUDA kernel's re-read vectors), an odd width (scalar path), 3-D.
GELU_CASES = [("gelu", (9, 7)), ("gelu", (33, 1000)), ("gelu", (2, 3, 8192)), ("gelu", (3, 40960)),
              ("gelu_mul", (5, 96)), ("gelu_mul", (4, 3, 2048)), ("gelu_mul", (2, 30000)),
              ("geglu", (6, 2 * 64)), ("geglu", (3, 2, 2 * 1024)), ("geglu", (3, 2 * 7))]


def gelu_call(kernel, form, x, up, approximate, scale=None):
    """The form's FP8 producer and its 16-bit op, on (x, up)."""
    if form == "gelu":
        return kernel.gelu_fp8(x, approximate, scale=scale), kernel.gelu(x, approximate)
    if form == "gelu_mul":
        return kernel.gelu_mul_fp8(x, up, approximate, scale=scale), kernel.gelu_mul(x, up, approximate)
    return kernel.geglu_fp8(x, approximate, scale=scale), kernel.geglu(x, approximate)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GELU_CASES, ids=str)
def test_gelu_fp8(kernel, fp8_device, case, dtype, approximate):
    """q and scales quantize the GELU op's fp32 value, which the op itself returns for fp32
    input (the same formulas; the input converts exactly), bit for bit; within one e4m3 step
    of fp64."""
    form, shape = case
    x = make(shape, dtype, fp8_device)
    up = make(shape, dtype, fp8_device) if form == "gelu_mul" else None
    (q, scales), _ = gelu_call(kernel, form, x, up, approximate)
    _, y = gelu_call(kernel, form, x.float(), None if up is None else up.float(), approximate)
    assert q.dtype == FP8 and q.is_contiguous() and q.shape == y.shape and scales.shape == (*y.shape[:-1], 1)
    assert_quantizes(q, scales, y)
    if form == "gelu":
        y64 = gelu64(x, approximate)
    elif form == "gelu_mul":
        y64 = gelu64(x, approximate) * up.double()
    else:
        value, gate = x.double().chunk(2, -1)
        y64 = value * gelu64(gate, approximate)
    assert_within_one_step(q, scales, y64)
    fixed = torch.tensor([0.02], device=fp8_device)
    (q_static, s), _ = gelu_call(kernel, form, x, up, approximate, fixed)
    assert s is fixed
    assert_bits(q_static, reference_quantize(y, fixed)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_fp8_strided_and_misaligned(kernel, fp8_device, dtype):
    """gate and up as slices of one fused projection (rows of one stride), and either one
    element off 16-byte alignment (the scalar path on CUDA), as gelu_mul computes them."""
    base = make((2, 5, 4 * 64), dtype, fp8_device)
    flat = base.flatten()
    for gate, up in ((base[..., :64], base[..., 64:128]),
                     (flat[1:1 + 640].view(2, 5, 64), flat[700:1340].view(2, 5, 64)),
                     (flat[:640].view(2, 5, 64), flat[641:1281].view(2, 5, 64))):  # up alone misaligned
        q, scales = kernel.gelu_mul_fp8(gate, up, "tanh")
        assert_quantizes(q, scales, kernel.gelu_mul(gate.float(), up.float(), "tanh"))


def test_gelu_fp8_refusals(kernel, fp8_device):
    x = make((2, 3, 32), torch.bfloat16, fp8_device)
    with pytest.raises(RuntimeError, match=r"^gelu_fp8: input has dtype Double; expected float32"):
        kernel.gelu_fp8(x.double())
    with pytest.raises(RuntimeError, match=r'^gelu_fp8: approximate must be "none" or "tanh", got "erf"'):
        kernel.gelu_fp8(x, "erf")
    with pytest.raises(RuntimeError, match=r"^gelu_mul_fp8: gate has dtype Double"):
        kernel.gelu_mul_fp8(x.double(), x.double())
    with pytest.raises(RuntimeError, match=r"^gelu_mul_fp8: up has dtype Float but gate has dtype BFloat16"):
        kernel.gelu_mul_fp8(x, x.float())
    with pytest.raises(RuntimeError, match=r"^gelu_mul_fp8: up has sizes \[2, 3, 16\] but expected \[2, 3, 32\]"):
        kernel.gelu_mul_fp8(x, x[..., :16])
    with pytest.raises(RuntimeError, match=r"^gelu_mul_fp8: up must be contiguous in its last dim"):
        kernel.gelu_mul_fp8(x[0], x[1].t().contiguous().t())
    with pytest.raises(RuntimeError, match=r"^geglu_fp8: input's last dim must be even"):
        kernel.geglu_fp8(x[..., :31])
    with pytest.raises(RuntimeError, match=r"^geglu_fp8_static: scale must be a float32 tensor of one element"):
        kernel.geglu_fp8(x, scale=torch.ones(2, device=fp8_device))
    with pytest.raises(RuntimeError, match=r"^gelu_mul_fp8_static: scale is on meta but gate is on"):
        kernel.gelu_mul_fp8(x, x, scale=torch.ones(1, device="meta"))
    with pytest.raises(RuntimeError, match=r"^gelu_mul_fp8: up requires grad, but FP8 outputs"):
        kernel.gelu_mul_fp8(x, x.clone().requires_grad_())
    with pytest.raises(RuntimeError, match=r"^gated_residual_adaln_fp8: residual has dtype Float; expected BFloat16"):
        kernel.gated_residual_adaln_fp8(x.float(), x, x[:, :1], x[:, :1], x[:, :1])
    with pytest.raises(RuntimeError, match=r"^gated_residual_adaln_fp8: gate requires grad, but FP8 outputs"):
        kernel.gated_residual_adaln_fp8(x, x, x[:, :1].clone().requires_grad_(), x[:, :1], x[:, :1])


def edge_rows(device):
    """fp32 rows of 64: zero, one huge value (saturation, the rest underflows), NaN, inf,
    fp32 subnormals (amax below 1e-12), e4m3 subnormals beside a large value, -0.0."""
    rows = torch.randn(8, 64)
    rows[0] = 0.0
    rows[1, 5] = 1e30
    rows[2, 3] = float("nan")
    rows[3, 7] = float("inf")
    rows[4] = torch.randn(64) * 1e-40
    rows[5, 0] = 448.0
    rows[5, 1:] = torch.linspace(-0.02, 0.02, 63)  # e4m3 subnormals at scale 1
    rows[6] = -0.0
    rows[7, :32] = float("-inf")
    return rows.to(device)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_fp8_edge_rows(kernel, fp8_device, dtype):
    x = edge_rows(fp8_device).to(dtype)
    q, scales = kernel.quantize_fp8(x)
    assert_quantizes(q, scales, x.float())
    # what the rows mean: a zero row's scale, a saturated maximum, NaN and inf rows
    assert scales[0].item() == pytest.approx(1e-12 / E4M3_MAX) and (q[0].float() == 0).all()
    if dtype != torch.float16:  # fp16 holds 1e30 as inf
        assert q[1, 5].float().item() == E4M3_MAX and scales[1].item() == pytest.approx(x[1, 5].item() / E4M3_MAX, rel=1e-6)
    assert scales[2].isnan().all() and q[2].float().isnan().all()
    assert scales[3].isinf().all()
    assert (q[5].float()[1:].abs() < 2.0**-6).any() and (q[5].float()[1:] != 0).any()  # e4m3 subnormals
    assert torch.signbit(q[6].float()).all()


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_fp8_edge_rows(kernel, fp8_device, dtype):
    x = edge_rows(fp8_device).to(dtype)
    w = torch.randn(64, device=fp8_device, dtype=dtype)
    q, scales = kernel.rms_norm_fp8(x, w, 1e-6)
    assert_quantizes(q, scales, rms_fp32(kernel, x, w, 1e-6, 0.0, False))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_views_3d_strided_and_misaligned(kernel, fp8_device, dtype):
    """3-D input; leading dims of one row stride (a fused projection's slice); a view one
    element off 16-byte alignment (the scalar path on CUDA)."""
    base = make((2, 5, 3 * 64), dtype, fp8_device)
    for x in (base[..., :64], base[..., 64:128].contiguous(), base.flatten()[1:1 + 10 * 64].view(2, 5, 64)):
        for op, y in ((kernel.quantize_fp8, x.float()), (lambda t: kernel.rms_norm_fp8(t, None, 1e-5),
                                                         rms_fp32(kernel, x, None, 1e-5, 0.0, False))):
            q, scales = op(x)
            assert q.shape == x.shape and q.is_contiguous() and scales.shape == (2, 5, 1)
            assert_quantizes(q, scales, y)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_static_scale(kernel, fp8_device, dtype):
    x = make((17, 96), dtype, fp8_device, scale=5.0)
    x[0, 0] = 1e4  # beyond 448 * scale: saturates
    scale = torch.tensor([0.05], device=fp8_device)
    q, s = kernel.quantize_fp8(x, scale)
    assert s is scale
    assert_bits(q, reference_quantize(x.float(), scale)[0])
    assert q[0, 0].float().item() == E4M3_MAX
    w = torch.randn(96, device=fp8_device, dtype=dtype)
    q, s = kernel.rms_norm_fp8(x, w, 1e-6, cast_before_weight=True, scale=scale)
    assert s is scale
    assert_bits(q, reference_quantize(rms_fp32(kernel, x, w, 1e-6, 0.0, True), scale)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_inputs(kernel, fp8_device, dtype):
    for shape in ((0, 16), (3, 0), (2, 0, 8)):
        x = torch.empty(shape, device=fp8_device, dtype=dtype)
        for q, scales in (kernel.quantize_fp8(x), kernel.rms_norm_fp8(x, None, 1e-6), kernel.gelu_fp8(x),
                          kernel.gelu_mul_fp8(x, x)):
            assert q.shape == shape and q.dtype == FP8 and scales.shape == (*shape[:-1], 1)
            assert bool((scales == 1e-12 / E4M3_MAX).all())  # rows of no elements: amax 0


@pytest.mark.kernels_ci
def test_scaled_mm_with_the_outputs(kernel, fp8_device):
    """torch._scaled_mm on (q, row scales) of activations and of a weight equals the matmul of
    their dequantized values within its accumulation's rounding (Hopper's FP8 tensor cores
    add in fewer bits than fp32: errors of ~2e-4 of the largest output were seen on an H200),
    far below what a wrong scale (a row off by a factor) would give."""
    a = make((32, 64), torch.bfloat16, fp8_device)
    b = make((48, 64), torch.bfloat16, fp8_device)
    w = torch.randn(64, device=fp8_device, dtype=torch.bfloat16)
    qa, sa = kernel.rms_norm_fp8(a, w, 1e-6)
    qb, sb = kernel.quantize_fp8(b)
    try:
        got = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.reshape(1, -1), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        pytest.fail(f"torch._scaled_mm refused the outputs: {e}")
    # In fp64 on the CPU: a CUDA fp32 matmul may round its operands to TF32.
    a64, b64 = qa.double().cpu() * sa.double().cpu(), qb.double().cpu() * sb.double().cpu()
    want = a64 @ b64.t()
    bound = 2.0**-10 * (a64.abs() @ b64.abs().t())  # per element: its terms' sum of magnitudes
    err = (got.double().cpu() - want).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.2e}, its bound {bound[err > bound].min():.2e}"


def test_refusals(kernel, fp8_device):
    x = make((4, 32), torch.bfloat16, fp8_device)
    for op in (kernel.quantize_fp8, lambda t: kernel.rms_norm_fp8(t, None, 1e-6)):
        for bad, message in ((x.double(), "input has dtype Double; expected float32, float16 or bfloat16"),
                             (x.int(), "input has dtype Int"),
                             (x.t(), "input must be contiguous in its last dim")):
            with pytest.raises(RuntimeError, match=r"(quantize_fp8|rms_norm_fp8): " + message):
                op(bad)
    for name, call in (("quantize_fp8_static", lambda s: kernel.quantize_fp8(x, s)),
                       ("rms_norm_fp8_static", lambda s: kernel.rms_norm_fp8(x, None, 1e-6, scale=s))):
        for bad in (torch.ones(2, device=fp8_device), torch.ones(1, device=fp8_device, dtype=torch.float16)):
            with pytest.raises(RuntimeError, match=rf"{name}: scale must be a float32 tensor of one element"):
                call(bad)
        with pytest.raises(RuntimeError, match=rf"{name}: scale is on meta but input is on {fp8_device}"):
            call(torch.ones(1, device="meta"))
        with pytest.raises(RuntimeError, match=rf"{name}: scale requires grad, but FP8 outputs are not differentiable"):
            call(torch.ones(1, device=fp8_device, requires_grad=True))
        with torch.no_grad():  # a scale that requires grad, used as a value
            call(torch.ones(1, device=fp8_device, requires_grad=True))


@pytest.mark.parametrize("op", ["quantize_fp8", "rms_norm_fp8"])
def test_inputs_that_require_grad_are_refused(kernel, fp8_device, op):
    """No derivative: a call autograd would record raises, naming the argument; without grad
    mode it runs."""
    x = make((4, 32), torch.float32, fp8_device).requires_grad_()
    w = torch.randn(32, device=fp8_device, requires_grad=True)
    call = (lambda: kernel.quantize_fp8(x)) if op == "quantize_fp8" else (lambda: kernel.rms_norm_fp8(x.detach(), w))
    arg = "input" if op == "quantize_fp8" else "weight"
    with pytest.raises(RuntimeError, match=rf"{op}: {arg} requires grad, but FP8 outputs are not differentiable"):
        call()
    with torch.no_grad():
        q, scales = call()
    assert q.grad_fn is None and not q.requires_grad


def test_refuses_gpus_before_sm89(kernel, device):
    """On CUDA, a GPU below compute capability 8.9 is refused with its capability named; from
    8.9 on the op runs."""
    if device != "cuda":
        pytest.skip("a CUDA GPU's capability")
    major, minor = torch.cuda.get_device_capability()
    x = torch.randn(4, 32, device=device)
    if (major, minor) >= (8, 9):
        assert kernel.quantize_fp8(x)[0].dtype == FP8
        return
    for call, op in ((lambda: kernel.quantize_fp8(x), "quantize_fp8"),
                     (lambda: kernel.rms_norm_fp8(x, None), "rms_norm_fp8")):
        with pytest.raises(RuntimeError, match=rf"^{op}: FP8 needs a GPU of compute capability 8.9 or newer "
                           rf"\(found {major}\.{minor}\)"):
            call()


@pytest.mark.parametrize("static", [False, True])
def test_compiled_shapes_and_dtypes(kernel, device, static):
    """torch.compile(fullgraph=True) on the CPU: the fakes' outputs are the eager ones, for
    static and dynamic sizes."""
    if device != "cpu":
        pytest.skip("compiled on the CPU")
    import torch._dynamo

    scale = torch.tensor([0.1]) if static else None

    def f(x, w):
        q1, s1 = kernel.quantize_fp8(x, scale)
        q2, s2 = kernel.rms_norm_fp8(x, w, 1e-6, scale=scale)
        q3, s3 = kernel.adaln_fp8(x, w, w, 1e-6, norm="rms", fp8_scale=scale)
        h, q4, s4 = kernel.gated_residual_adaln_fp8(x, x, w, w, w, 1e-6, norm="layer", fp8_scale=scale)
        q5, s5 = kernel.gelu_mul_fp8(x, x, "tanh", scale=scale)
        q6, s6 = kernel.geglu_fp8(x, "none", scale=scale)
        return q1, s1, q2, s2, q3, s3, h, q4, s4, q5, s5, q6, s6

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for shape in ((4, 64), (2, 3, 64), (7, 64)):
        x, w = torch.randn(shape, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
        for got, want in zip(compiled(x, w), f(x, w)):
            assert got.shape == want.shape and got.dtype == want.dtype and got.stride() == want.stride()
            assert_bits(got, want)


def test_fake_outputs_match_real(kernel, device):
    """Under FakeTensorMode the ops give the real outputs' sizes, strides and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = make((3, 5, 40), torch.float16, device)
    w, scale = torch.randn(40, device=device, dtype=torch.float16), torch.tensor([0.5], device=device)
    calls = [lambda x, w, s: kernel.ops.quantize_fp8(x), lambda x, w, s: kernel.ops.quantize_fp8_static(x, s),
             lambda x, w, s: kernel.ops.rms_norm_fp8(x, w, 1e-6, 0.0, False),
             lambda x, w, s: kernel.ops.rms_norm_fp8_static(x, w, 1e-6, 1.0, True, s),
             lambda x, w, s: kernel.ops.adaln_fp8(x, w, w, 1e-6, "layer"),
             lambda x, w, s: kernel.ops.adaln_fp8_static(x, w, w, 1e-6, "rms", s),
             lambda x, w, s: kernel.ops.gated_residual_adaln_fp8(x, x, w, w, w, 1e-6, "rms"),
             lambda x, w, s: kernel.ops.gated_residual_adaln_fp8_static(x, x, w, w, w, 1e-6, "layer", s),
             lambda x, w, s: kernel.ops.gelu_fp8(x, "tanh"), lambda x, w, s: kernel.ops.gelu_fp8_static(x, "none", s),
             lambda x, w, s: kernel.ops.gelu_mul_fp8(x, x, "none"),
             lambda x, w, s: kernel.ops.gelu_mul_fp8_static(x, x, "tanh", s),
             lambda x, w, s: kernel.ops.geglu_fp8(x, "tanh"), lambda x, w, s: kernel.ops.geglu_fp8_static(x, "none", s)]
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fakes = [mode.from_tensor(t) for t in (x, w, scale)]
        fake_results = [call(*fakes) for call in calls]
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        return
    for call, fake in zip(calls, fake_results):
        real = call(x, w, scale)
        for r, f in zip(real if isinstance(real, tuple) else (real,), fake if isinstance(fake, tuple) else (fake,)):
            assert (r.shape, r.stride(), r.dtype, r.device) == (f.shape, f.stride(), f.dtype, f.device)

