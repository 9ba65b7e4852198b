"""Each op's error bound vs an fp64 reference, per dtype, as docs/numerics.md states it:

    |y - ref| <= rtol * |ref| + atol * M

with rtol = roundings * U(dtype), U = 2^-10 (fp16), 2^-7 (bf16), 1e-5 (fp32, which
covers fp32 arithmetic as well as the rounding); atol = max(1e-5, atol_ulps * U) and M
the magnitude of the inputs for ops whose output scales with them (1 for norms).
Asserted on random rows, on large-magnitude rows (x^2 overflows fp16; the fp32
accumulation must not), on rows of zeros and tiny rows (eps decides the result), on D = 1,
and where the exact result overflows the output dtype (it must be Inf there)."""

import pytest
import torch

from test_bad_inputs import APIS, EPS, Dims, norm_ref, rms_norm_ref

U = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}
DTYPES = list(U)

# op -> (roundings, atol_ulps, output scales with the inputs). The docs' table.
BOUNDS = {
    "rms_norm": (1, 0, False),
    "fused_add_rms_norm": (1, 0, False),
    "adaln": (1, 0, False),
    "gated_residual": (1, 0, True),
    "gated_residual_adaln": (1, 0, True),
    "rope_rotate_half": (1, 0, True),
    "rope_interleaved": (1, 0, True),
    # normed q/k rounded as torch.nn.RMSNorm returns them, then the rotation: where its
    # two terms cancel, a tie of the first rounding shows as one ulp of |normed| (<= 4).
    "qk_norm_rope": (3, 4, False),
    "gelu": (1, 0, True),
    "gelu_mul": (1, 0, True),
    "geglu": (1, 0, True),
    # transformers' Llama order rounds the normed value to x's dtype before the weight.
    "layers.RMSNorm": (2, 4, False),
    "layers.RMSNormZeroCentered": (1, 0, False),
    "layers.GeluTanh": (1, 0, True),
}
OPS = [api for api in APIS if api.name in BOUNDS]
ROW_INPUTS = ("rows", "heads")  # what "the input" of an op is, as opposed to weights and tables


def assert_within_bound(api, outputs, expected, dtype, magnitude=1.0):
    roundings, atol_ulps, scales = BOUNDS[api.name]
    rtol = roundings * U[dtype]
    atol = max(1e-5, atol_ulps * U[dtype]) * (magnitude if scales else 1.0)
    for actual, (want, want_dtype) in zip(outputs, expected):
        assert actual.dtype == want_dtype
        actual, want = actual.double().cpu(), want.cpu()
        # Where the exact value overflows the output dtype, the rounded result is +-Inf.
        overflow = want.isfinite() & want.to(want_dtype).isinf()
        assert torch.equal(actual[overflow], want.to(want_dtype).double()[overflow]), "overflow must give Inf"
        torch.testing.assert_close(actual[~overflow], want[~overflow], rtol=rtol, atol=atol, equal_nan=True)


def run(api, kernel, tensors):
    expected = api.ref({k: v.clone() for k, v in tensors.items()})
    return api.call(kernel, tensors), expected


def scale_inputs(api, tensors, factor):
    for arg in api.args:
        if arg.kind in ROW_INPUTS:
            tensors[arg.key] = tensors[arg.key] * factor


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("api", OPS, ids=lambda a: a.name)
def test_error_bound_on_random_rows(kernel, device, api, dtype):
    tensors = api.make(Dims(b=3, s=17, d=1000 if "rope" not in api.name else 128, heads=3, rotary=96), dtype, device)
    assert_within_bound(api, *run(api, kernel, tensors), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("api", OPS, ids=lambda a: a.name)
def test_large_magnitude_rows(kernel, device, api, dtype):
    """|x| up to ~1000: x^2 overflows fp16 (|x| > 256); sums of squares stay fp32.
    Outputs that exceed the dtype (gelu_mul, geglu products) must be Inf like the
    reference rounded."""
    tensors = api.make(Dims(b=2, s=5, d=512 if "rope" not in api.name else 64, heads=2, rotary=64), dtype, device)
    scale_inputs(api, tensors, 150.0)
    x = tensors[api.primary.key]
    if dtype == torch.float16:
        assert (x.float().square() > torch.finfo(torch.float16).max).any(), "some x^2 must overflow fp16"
    outputs, expected = run(api, kernel, tensors)
    if not BOUNDS[api.name][2]:
        assert all(o.isfinite().all() for o in outputs), "normalised outputs of finite rows are finite"
    assert_within_bound(api, outputs, expected, dtype, magnitude=150.0 * 3)


NORM_OPS = [api for api in OPS if not BOUNDS[api.name][2] or "adaln" in api.name]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("api", NORM_OPS, ids=lambda a: a.name)
def test_rows_of_zeros(kernel, device, api, dtype):
    """A zero row normalises to exactly 0 (eps keeps rsqrt finite); AdaLN then gives
    exactly shift. Other rows are unaffected."""
    tensors = api.make(Dims(b=2, s=3, d=256), dtype, device)
    for arg in api.args:
        if arg.kind in ROW_INPUTS:
            tensors[arg.key][:, 1] = 0  # token 1 of every batch entry
    outputs, expected = run(api, kernel, tensors)
    assert_within_bound(api, outputs, expected, dtype)
    for out, (want, want_dtype) in zip(outputs, expected):
        assert torch.equal(out[:, 1].cpu(), want[:, 1].to(want_dtype).cpu()), "zero rows are exact"
        if "adaln" not in api.name:
            assert (out[:, 1] == 0).all()


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eps_decides_tiny_rows(kernel, device, dtype, norm):
    """mean(x^2) ~ eps: the result follows rsqrt(mean + eps), clearly not rsqrt(mean)."""
    x = (torch.randn(4, 2, 300) * 1e-3).to(device=device, dtype=dtype)
    zeros = torch.zeros(300, dtype=dtype, device=device)
    y = kernel.adaln(x, zeros, zeros, EPS, norm=norm)
    want, without_eps = norm_ref(x, EPS, norm), norm_ref(x, 0.0, norm)
    torch.testing.assert_close(y.double(), want, rtol=U[dtype], atol=1e-5)
    change = (want - without_eps).norm(dim=-1) / without_eps.norm(dim=-1)
    assert (change > 10 * U[dtype]).all(), "eps must matter for these rows"
    if norm == "rms":
        y = kernel.rms_norm(x, None, EPS)
        torch.testing.assert_close(y.double(), rms_norm_ref(x, None, EPS), rtol=U[dtype], atol=1e-5)


def d_equals_1(api):
    """D = 1 (rope and geglu: the smallest rows they take, D = 2)."""
    if "rope" in api.name:
        return Dims(b=2, s=3, d=2, heads=2, rotary=2)
    return Dims(b=2, s=3, d=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("api", OPS, ids=lambda a: a.name)
def test_last_dim_of_one(kernel, device, api, dtype):
    """D = 1: RMSNorm gives x / sqrt(x^2 + eps) (~ sign(x)), LayerNorm gives 0 (so AdaLN
    gives shift); one-element rows take the scalar path on CUDA."""
    tensors = api.make(d_equals_1(api), dtype, device)
    outputs, expected = run(api, kernel, tensors)
    assert_within_bound(api, outputs, expected, dtype, magnitude=3.0)


# Row widths of LayerNorm's launches on CUDA (fp32 / 16-bit): one or two vectors a thread,
# four, and rows re-read past the four cached vectors.
LAYER_WIDTHS = (1000, 4096, 40000)


@pytest.mark.parametrize("d", LAYER_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_of_constant_rows_is_exact(kernel, device, dtype, d):
    """A constant row's LayerNorm is exactly 0 (its mean is the row's value exactly), so
    AdaLN gives exactly shift, the gated residual's form too (its row: residual + 0 * gate);
    with eps = 0 it is 0 / 0, NaN, as PyTorch's layer_norm gives."""
    values = torch.tensor([0.1, 3.7, -1234.5, 1e-3, 7.0, -0.3]).to(dtype)  # one per token
    x = values.view(1, -1, 1).expand(2, -1, d).contiguous().to(device)
    scale = torch.randn(2, 1, d, dtype=dtype, device=device)
    shift = torch.randn(2, 1, d, dtype=dtype, device=device)
    assert torch.equal(kernel.adaln(x, scale, shift, EPS, norm="layer"), shift.expand_as(x))
    gate = torch.randn(2, 1, d, dtype=dtype, device=device)
    residual_out, out = kernel.gated_residual_adaln(x, torch.zeros_like(x), gate, scale, shift, EPS, norm="layer")
    assert torch.equal(residual_out, x) and torch.equal(out, shift.expand_as(x))
    assert torch.nn.functional.layer_norm(x.double(), (d,), eps=0.0).isnan().all()
    assert kernel.adaln(x, scale, shift, 0.0, norm="layer").isnan().all()
    # In place, where the residual sum overwrites the residual that every thread reads.
    residual = x.clone()
    kernel.gated_residual_adaln(residual, torch.zeros_like(x), gate, scale, shift, EPS, norm="layer",
                                residual_out=residual, out=out)
    assert torch.equal(residual, x) and torch.equal(out, shift.expand_as(x))


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_long_fp32_rows_keep_the_error_bound(kernel, device, norm):
    """Rows of 2^22 fp32 elements: the row sums' error does not grow with the length
    (blocked lanes and compensated sums, docs/numerics.md), so the result stays within a
    few roundings of the fp64 reference, as PyTorch's own fp32 norms do; plain fp32 lane
    sums were ~100x off for LayerNorm here."""
    n = 2**22
    generator = torch.Generator().manual_seed(0)
    x = (1.0 + 0.01 * torch.randn(2, 1, n, generator=generator)).to(device)
    zeros = torch.zeros(n, device=device)
    want = norm_ref(x, EPS, norm)
    error = (kernel.adaln(x, zeros, zeros, EPS, norm=norm).double() - want).abs().max().item()
    if norm == "rms":
        torch_error = (torch.nn.functional.rms_norm(x, (n,), eps=EPS).double() - want).abs().max().item()
    else:
        torch_error = (torch.nn.functional.layer_norm(x, (n,), eps=EPS).double() - want).abs().max().item()
    assert error <= 8 * max(torch_error, 2**-24 * want.abs().max().item()), (error, torch_error)
