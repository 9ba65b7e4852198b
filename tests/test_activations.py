"""The GELU family against fp64 references: gelu, gelu_mul (Gemma) and geglu (diffusers)."""

import pytest
import torch
import torch.nn.functional as F

from reference import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
APPROX = ["none", "tanh"]
SHAPES = [(1, 8), (33, 1000), (8, 5120), (3, 7, 1001), (2048, 64)]


def make(shape, dtype, device, scale=2.0):
    return (torch.randn(shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def gelu64(x, approximate):
    return F.gelu(x.double(), approximate=approximate)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gelu(kernel, device, shape, dtype, approximate):
    x = make(shape, dtype, device)
    assert_close(kernel.gelu(x, approximate), gelu64(x, approximate), dtype)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gelu_mul(kernel, device, shape, dtype, approximate):
    gate, up = make(shape, dtype, device), make(shape, dtype, device)
    assert_close(kernel.gelu_mul(gate, up, approximate), gelu64(gate, approximate) * up.double(), dtype)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 16), (33, 2000), (8, 10240), (3, 7, 2002), (4096, 128)], ids=str)
def test_geglu_takes_the_gate_from_the_second_half(kernel, device, shape, dtype, approximate):
    x = make(shape, dtype, device)
    value, gate = x.chunk(2, dim=-1)
    y = kernel.geglu(x, approximate)
    assert y.shape == value.shape
    assert_close(y, value.double() * gelu64(gate, approximate), dtype)


def test_erf_form_keeps_its_relative_error_in_the_negative_tail(kernel, device):
    """Exact GELU's Phi is a fitted polynomial and one exp2 (kernel_src/activation_math.h),
    not 1 + erf(x / sqrt 2), which loses digits to cancellation as x falls (PyTorch's fp32
    gelu: about 5e-4 relative at x = -4). Its fp32 error stays under 4e-6 relative down to
    x = -6 (3.5e-6 at most on the CPU, every float of [-6, -5] scanned), and the grad's
    under 1e-6 absolute."""
    x = torch.linspace(-6, 6, 240001, dtype=torch.float32, device=device).requires_grad_()
    y = kernel.gelu(x, "none")
    y.backward(torch.ones_like(y))
    x64 = x.detach().double().requires_grad_()
    ref = F.gelu(x64)
    ref.backward(torch.ones_like(ref))
    relative = (y.detach().double() - ref).abs() / ref.abs().clamp_min(1e-300)  # y = ref = 0 at x = 0
    assert relative.max().item() < 4e-6, f"at x = {x[relative.argmax()].item()}"
    assert (x.grad.double() - x64.grad).abs().max().item() < 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_and_misaligned_inputs(kernel, device, dtype):
    wide = make((9, 1030), dtype, device)
    gate, up = wide[:, 3:1027], wide[:, 1:1025]  # row stride 1030, odd element offsets
    assert_close(kernel.gelu_mul(gate, up), gelu64(gate, "tanh") * up.double(), dtype)
    assert_close(kernel.gelu(gate, "none"), gelu64(gate, "none"), dtype)
    assert_close(kernel.geglu(wide[:, 2:1026]), wide[:, 2:514].double() * gelu64(wide[:, 514:1026], "none"), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_variants_write_every_element(kernel, device, dtype):
    x = make((17, 512), dtype, device)
    out = torch.full((17, 256), float("nan"), dtype=dtype, device=device)
    assert kernel.geglu(x, out=out) is out
    assert_close(out, x[:, :256].double() * gelu64(x[:, 256:], "none"), dtype)
    out2 = torch.full_like(x, float("nan"))
    kernel.gelu(x, "tanh", out=out2)
    assert_close(out2, gelu64(x, "tanh"), dtype)
    kernel.gelu_mul(x, x, out=out2)
    assert_close(out2, gelu64(x, "tanh") * x.double(), dtype)


def test_empty_inputs(kernel, device):
    for shape in [(0, 64), (2, 0), (0,)]:
        x = torch.empty(shape, device=device)
        assert kernel.gelu(x).shape == x.shape
    assert kernel.geglu(torch.empty(0, 64, device=device)).shape == (0, 32)


@pytest.mark.parametrize("approximate", APPROX)
def test_nan_and_inf_propagate(kernel, device, approximate):
    """NaN stays NaN; gelu(+inf) = +inf (the formula's limit, and F.gelu's tanh form);
    gelu(-inf) is -inf * 0 = NaN in both forms, as in PyTorch."""
    x = torch.tensor([[float("nan"), float("inf"), float("-inf"), 0.0, 1.0]], device=device)
    y = kernel.gelu(x, approximate)
    assert y[0, 0].isnan() and y[0, 1] == float("inf") and y[0, 2].isnan() and y[0, 3] == 0
    assert F.gelu(x, approximate="tanh")[0, 2].isnan(), "PyTorch agrees on -inf"
    torch.testing.assert_close(y[0, 4:].double(), gelu64(x[0, 4:], approximate))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("approximate", APPROX)
def test_grad_far_out_matches_pytorch(kernel, device, dtype, approximate):
    """Far from 0 gelu's grad is 0 (negative) or 1 (positive), as PyTorch's fp32 backward
    gives, up to |x| ~ 1.8e19 where x * x overflows fp32 and both become NaN."""
    x = torch.tensor([-1e19, -1.3e13, -40.0, -3.0, 3.0, 40.0, 1.3e13, 1e19], device=device).to(dtype)
    ours = x.clone().requires_grad_()
    kernel.gelu(ours, approximate).backward(torch.ones_like(ours))
    host = x.clone().requires_grad_()
    F.gelu(host, approximate=approximate).backward(torch.ones_like(host))
    assert not host.grad.isnan().any()
    assert_close(ours.grad, host.grad.double(), dtype, roundings=2)


def _bad_calls(k, device):
    x = torch.randn(4, 64, device=device, dtype=torch.float16)
    return {
        "approximate_name": (lambda: k.gelu(x, "fast"), 'approximate must be "none" or "tanh"'),
        "geglu_odd_dim": (lambda: k.geglu(torch.randn(4, 63, device=device)), "last dim must be even"),
        "up_shape": (lambda: k.gelu_mul(x, x[:, :32]), "up has sizes"),
        "up_dtype": (lambda: k.gelu_mul(x, x.float()), "up has dtype Float but gate has dtype Half"),
        "int_input": (lambda: k.gelu(torch.ones(4, 64, dtype=torch.int64, device=device)), "input has dtype Long"),
        "out_shape": (lambda: k.geglu(x, out=torch.empty(4, 64, dtype=torch.float16, device=device)),
                      "out has sizes"),
        "transposed": (lambda: k.gelu(x.t()), "contiguous in its last dim"),
    }


@pytest.mark.parametrize("case", list(_bad_calls(None, "cpu")))
def test_bad_input_raises_a_clear_error(kernel, device, case):
    call, message = _bad_calls(kernel, device)[case]
    with pytest.raises(RuntimeError, match=message):
        call()


def test_partly_overlapping_out_is_refused(kernel, device):
    buf = torch.randn(9, 64, device=device)
    with pytest.raises(RuntimeError, match="out partly overlaps an input"):
        kernel.gelu(buf[:8], out=buf[1:])
