"""RMSNorm against the fp64 reference, over shapes, dtypes, layouts and bad input."""

import pytest
import torch

from reference import TOLERANCE, assert_close, rms_norm_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DIMS = [64, 128, 1000, 1536, 2048, 3072, 4096, 6144, 8192, 65536]
MAX_ELEMENTS = 13_000_000  # keeps the CPU run short; the GPU run uses the same grid
# 20000 x 512 and 10000 x 1024: on CUDA, 16-bit rows that take two vectors a thread at any
# batch (the widest: 1024). 3072 in fp32 and 6144 in 16 bits: rows of 768 vectors on the
# two-vector launch's 512 threads, half of them without a second vector. 8999 x 1100: in
# fp32, four-vector rows of 128 threads (275 vectors on 512 slots) at over 64 rows per SM,
# and a row count no power of two divides, for launches that pack several rows a block.
# 300 x 65536 and 300 x 40008 at over two rows per SM: in 16 bits, rows of eight vectors a
# thread on 1024 threads (40008: the last part full); in fp32 wider rows, of which sm_80 and
# sm_90 keep what the registers do not hold in shared memory (as 33 x 131072 in 16 bits)
# and sm_75 re-reads the rest past four vectors a thread. 33 and 300 x 24576: eight-vector
# rows of 1024 threads (fp32) and, in 16 bits at 300 rows, of 512 threads, the last part
# full.
SHAPES = [(rows, d) for d in DIMS for rows in (1, 33, 1000, 100_000) if rows * d <= MAX_ELEMENTS] + [
    (20_000, 512), (10_000, 1024), (8_999, 1100), (300, 65536), (300, 40_008), (33, 24_576), (300, 24_576),
    (33, 131_072)]


def make(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(kernel, device, shape, dtype, with_weight):
    x = make(shape, dtype, device, scale=3.0)
    w = make(shape[-1:], dtype, device) if with_weight else None
    assert_close(kernel.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 5, 96), (1, 7, 4, 128), (3, 1, 1, 1, 2048)], ids=str)
def test_leading_dims(kernel, device, shape, dtype):
    x, w = make(shape, dtype, device), make(shape[-1:], dtype, device)
    y = kernel.rms_norm(x, w, 1e-5)
    assert y.shape == x.shape
    assert_close(y, rms_norm_ref(x, w, 1e-5), dtype)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1, 3, 111, 769, 5125, 32771])
def test_odd_last_dim(kernel, device, d, dtype):
    """Last dims that are not a multiple of the vector width take the scalar path."""
    x, w = make((17, d), dtype, device), make((d,), dtype, device)
    assert_close(kernel.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_misaligned_pointers(kernel, device, dtype):
    """Views at an odd element offset are not 16-byte aligned: the scalar path runs."""
    rows, d = 9, 1024
    x = make((rows * d + 1,), dtype, device)[1:].view(rows, d)
    w = make((d + 1,), dtype, device)[1:]
    assert x.data_ptr() % 16 != 0 and w.data_ptr() % 16 != 0
    assert_close(kernel.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)


# D = 512 in 16 bits shares 128-thread blocks between rows on CUDA; 2048 takes a block a row.
@pytest.mark.kernels_ci
@pytest.mark.parametrize("d", [512, 2048])
@pytest.mark.parametrize("pad", [8, 1], ids=["aligned_stride", "odd_stride"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_rows(kernel, device, dtype, pad, d):
    """A slice such as qkv[..., :D] is normalised in place of a copy."""
    wide = make((3, 11, d + pad), dtype, device)
    x = wide[..., :d]
    w = make((d,), dtype, device)
    assert not x.is_contiguous()
    y = kernel.rms_norm(x, w, 1e-6)
    assert y.is_contiguous()
    assert_close(y, rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_variant_writes_every_element(kernel, device, dtype):
    x, w = make((37, 2048), dtype, device), make((2048,), dtype, device)
    out = torch.full_like(x, float("nan"))
    result = kernel.rms_norm(x, w, 1e-6, out=out)
    assert result is out
    assert_close(out, rms_norm_ref(x, w, 1e-6), dtype)


# On CUDA, 300 x 32768 and 33 x 65536 take the eight-vector rows in 16 bits (and 300 x
# 32768 in fp32), which read the row before their barrier and write it after.
@pytest.mark.kernels_ci
@pytest.mark.parametrize("shape", [(64, 4096), (300, 32768), (33, 65536)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place(kernel, device, dtype, shape):
    x, w = make(shape, dtype, device), make(shape[-1:], dtype, device)
    expected = rms_norm_ref(x, w, 1e-6)
    kernel.rms_norm(x, w, 1e-6, out=x)
    assert_close(x, expected, dtype)


@pytest.mark.parametrize("d, weighted", [(256, False), (2048, True), (2048, False)],
                         ids=["d256_no_weight", "d2048_weight", "d2048_no_weight"])
@pytest.mark.parametrize("out_strided", [False, True])
def test_strided_out(kernel, device, out_strided, d, weighted):
    x = make((5, d), torch.bfloat16, device)
    w = make((d,), torch.bfloat16, device) if weighted else None
    wide = torch.full((5, d + 8 * out_strided), float("nan"), dtype=torch.bfloat16, device=device)
    out = wide[:, :d]
    kernel.rms_norm(x, w, 1e-6, out=out)
    assert_close(out, rms_norm_ref(x, w, 1e-6), torch.bfloat16)
    if out_strided:
        assert wide[:, d:].isnan().all(), "wrote past the out rows"


@pytest.mark.parametrize("shape", [(0, 128), (2, 0, 64), (0, 1)], ids=str)
def test_empty_leading_dims(kernel, device, shape):
    x = torch.empty(shape, dtype=torch.float16, device=device)
    y = kernel.rms_norm(x, torch.ones(shape[-1], dtype=torch.float16, device=device), 1e-6)
    assert y.shape == x.shape and y.dtype == x.dtype


def test_zero_rows_use_eps(kernel, device):
    x = torch.zeros(3, 256, device=device)
    x[1] = 1.0
    y = kernel.rms_norm(x, None, 1e-6)
    assert (y[0] == 0).all() and (y[2] == 0).all()
    assert_close(y, rms_norm_ref(x, None, 1e-6), torch.float32)


def test_fp16_rows_whose_squares_overflow_fp16(kernel, device):
    """x^2 overflows fp16 at |x| > 256; accumulation is fp32, so the result is exact."""
    x = make((8, 4096), torch.float16, device, scale=5000.0)
    assert x.isfinite().all() and x.abs().max() > 256
    assert_close(kernel.rms_norm(x, None, 1e-6), rms_norm_ref(x, None, 1e-6), torch.float16)


def test_nan_and_inf_propagate_like_the_reference(kernel, device):
    x = make((4, 300), torch.float32, device)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    y, ref = kernel.rms_norm(x, None, 1e-6), rms_norm_ref(x, None, 1e-6)
    assert y[1].isnan().all() and ref[1].isnan().all()
    assert torch.equal(y[2].isnan(), ref[2].isnan())
    torch.testing.assert_close(y[[0, 3]].double(), ref[[0, 3]], **TOLERANCE[torch.float32])


def test_bitwise_deterministic(kernel, device):
    x, w = make((333, 8192), torch.bfloat16, device), make((8192,), torch.bfloat16, device)
    assert torch.equal(kernel.rms_norm(x, w, 1e-6), kernel.rms_norm(x, w, 1e-6))


def _bad_inputs(device):
    f16 = dict(dtype=torch.float16, device=device)
    x = torch.randn(4, 64, **f16)
    return {
        "weight_shape": (lambda: (x, torch.ones(32, **f16)), r"weight must have shape \[64\]"),
        "weight_2d": (lambda: (x, torch.ones(1, 64, **f16)), r"weight must have shape \[64\]"),
        "weight_dtype": (lambda: (x, torch.ones(64, dtype=torch.float64, device=device)),
                         "weight has dtype Double but input has dtype Half"),
        "int_input": (lambda: (torch.ones(4, 64, dtype=torch.int32, device=device), None),
                      "input has dtype Int; expected float32, float16 or bfloat16"),
        # the CPU takes float64 with a float64 weight (test_gradcheck), never a float32 one
        "fp64_input_fp32_weight": (lambda: (torch.ones(4, 64, dtype=torch.float64, device=device),
                                            torch.ones(64, device=device)), "input has dtype Double"),
        "zero_dim": (lambda: (torch.tensor(1.0, **f16), None), "input must have at least 1 dim"),
        "transposed": (lambda: (torch.randn(64, 4, **f16).t(), None), "contiguous in its last dim"),
        "uncollapsible": (lambda: (torch.randn(6, 4, 64, **f16).transpose(0, 1), None),
                          "do not collapse into rows of one stride"),
    }


@pytest.mark.kernels_ci
@pytest.mark.parametrize("case", list(_bad_inputs("cpu")))
def test_bad_input_raises_a_clear_error(kernel, device, case):
    make_args, message = _bad_inputs(device)[case]
    x, w = make_args()
    with pytest.raises(RuntimeError, match=message):
        kernel.rms_norm(x, w, 1e-6)


def test_bad_out_and_eps(kernel, device):
    x = torch.randn(4, 64, device=device)
    with pytest.raises(RuntimeError, match=r"out has sizes \[4, 32\] but input has sizes \[4, 64\]"):
        kernel.rms_norm(x, None, 1e-6, out=torch.empty(4, 32, device=device))
    with pytest.raises(RuntimeError, match="out has dtype Half but input has dtype Float"):
        kernel.rms_norm(x, None, 1e-6, out=torch.empty(4, 64, dtype=torch.float16, device=device))
    with pytest.raises(RuntimeError, match="eps must be >= 0"):
        kernel.rms_norm(x, None, -1.0)


def test_mixed_devices_raise(kernel, device):
    if device != "cuda":
        pytest.skip("needs a GPU tensor beside a CPU one")
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(RuntimeError, match="weight is on cpu but input is on cuda:0"):
        kernel.rms_norm(x, torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="out is on cpu but input is on cuda:0"):
        kernel.rms_norm(x, None, 1e-6, out=torch.empty(4, 64))
