"""The rest of the norm family against fp64 references: RMSNorm variants (zero-centred
weight, cast orders, fp32 weight), fused add + RMSNorm, AdaLN (RMS and LayerNorm) and the
gated residual with and without the fused AdaLN."""

import pytest
import torch

from reference import (adaln_checking_stats, adaln_ref, assert_close, gated_residual_ref, layer_norm_ref,
                       rms_norm_ref)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LOW = [torch.float16, torch.bfloat16]
# (rows, D): vector paths of each launch shape, odd D (scalar path), per-head D; 300 rows
# take the large-batch launch on CUDA, where the residual variants' rows of up to 256
# vectors take one vector a thread (1800: lanes past the row's 225 16-bit vectors idle)
# and the others' rows of up to 1024 two (under 64 rows per SM; test_rms_norm's 100000
# rows take four).
SHAPES = [(1, 64), (37, 128), (33, 1000), (5, 1536), (64, 2048), (3, 4096), (2, 65536), (9, 1001),
          (300, 1000), (300, 1800)]


def make(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def shape_id(s):
    return "x".join(map(str, s))


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_zero_centred_weight(kernel, device, shape, dtype):
    """Gemma / Qwen3.5: norm(x) * (1 + w), weights near zero."""
    x, w = make(shape, dtype, device), make(shape[-1:], dtype, device, scale=0.1)
    y = kernel.rms_norm(x, w, 1e-6, weight_offset=1.0)
    assert_close(y, rms_norm_ref(x, w, 1e-6, weight_offset=1.0), dtype)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_cast_before_weight(kernel, device, shape, dtype):
    """Llama order: round norm(x) to the input dtype, then multiply by the weight."""
    x, w = make(shape, dtype, device), make(shape[-1:], dtype, device)
    y = kernel.rms_norm(x, w, 1e-6, cast_before_weight=True)
    # Two roundings, as the host; the reference rounds its fp64 value, which can tie differently.
    assert_close(y, rms_norm_ref(x, w, 1e-6, cast_before_weight=True), dtype, roundings=2)


# The Llama order rounds twice: the norm to the input's dtype, then its product with the
# weight, which is exact in fp32 (CUDA's wide rows multiply 16-bit pairs, each product
# rounded once). So it equals the weightless norm of the same rows times the weight,
# rounded once, where CUDA takes both in one kernel with one sum: eight vectors a thread
# (the wide rows: 65536, 32768) or four (the general kernel: 33 x 16384 over 1024 threads a
# row; 10000 x 4096, at least 64 rows per SM up to 156 SMs, as on H100/H200's 132 and
# L40S's 142). Weighted two-vector rows take a kernel of their own whose sum of squares
# adds in another order (fp16 1000 x 2048 then differs by an ulp), so they are not
# compared here.
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("shape", [(2, 65536), (33, 65536), (300, 32768), (33, 16384), (10000, 4096)], ids=shape_id)
def test_cast_before_weight_rounds_the_weighted_product_once(kernel, device, shape, dtype):
    x, w = make(shape, dtype, device), make(shape[-1:], dtype, device)
    normed = kernel.rms_norm(x, None, 1e-6)
    y = kernel.rms_norm(x, w, 1e-6, cast_before_weight=True)
    assert torch.equal(y, (normed.float() * w.float()).to(dtype))


@pytest.mark.parametrize("cast_before_weight", [False, True])
@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["out_input_dtype", "out_fp32"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_fp32_weight_with_low_precision_input(kernel, device, dtype, out_dtype, cast_before_weight):
    x, w = make((29, 768), dtype, device), make((768,), torch.float32, device)
    y = kernel.rms_norm(x, w, 1e-6, cast_before_weight=cast_before_weight, out_dtype=out_dtype)
    expected = rms_norm_ref(x, w, 1e-6, cast_before_weight=cast_before_weight)
    assert y.dtype == (out_dtype or dtype)
    # Roundings: to the input dtype before the weight (Llama order), then to the output.
    tol_dtype = dtype if cast_before_weight else y.dtype
    assert_close(y.to(tol_dtype), expected, tol_dtype, roundings=2 if cast_before_weight else 1)


def test_fp32_out_needs_fp32_weight(kernel, device):
    x = make((4, 64), torch.bfloat16, device)
    with pytest.raises(RuntimeError, match="a float32 out needs a float32 weight"):
        kernel.rms_norm(x, make((64,), torch.bfloat16, device), out_dtype=torch.float32)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_fused_add_rms_norm(kernel, device, shape, dtype, with_weight):
    x, res = make(shape, dtype, device), make(shape, dtype, device)
    w = make(shape[-1:], dtype, device) if with_weight else None
    y, h = kernel.fused_add_rms_norm(x, res, w, 1e-6)
    h_ref = (x.double() + res.double()).to(dtype)
    assert torch.equal(h, h_ref), "the residual sum is rounded once to the input dtype"
    assert_close(y, rms_norm_ref(h_ref, w, 1e-6), dtype)


# Decode rows (CUDA: the residual row kernel, two vectors a thread up to 1024 vectors, four
# up to 2048; 2568 wide leaves the last warps partly or wholly without a vector) with each
# option of the op: Gemma's weight offset, the Llama order. Within an ulp or two of fp64,
# and equal to the fp64 formula rounded to the dtype in all but rare elements (a tie of the
# norm's rounding): rounding before the weight or not changes about a quarter of them.
@pytest.mark.parametrize("cast_before_weight", [False, True], ids=["fp32_weight", "llama_order"])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0], ids=["w", "1+w"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2568), (5, 4096), (2, 8192), (2, 16384)], ids=shape_id)
def test_fused_add_rms_norm_options(kernel, device, shape, dtype, weight_offset, cast_before_weight):
    x, res = make(shape, dtype, device), make(shape, dtype, device)
    w = make(shape[-1:], dtype, device, scale=0.1 if weight_offset else 1.0)
    y, h = kernel.fused_add_rms_norm(x, res, w, 1e-6, weight_offset=weight_offset,
                                     cast_before_weight=cast_before_weight)
    h_ref = (x.double() + res.double()).to(dtype)
    assert torch.equal(h, h_ref)
    y_ref = rms_norm_ref(h_ref, w, 1e-6, weight_offset=weight_offset, cast_before_weight=cast_before_weight)
    roundings = 2 if cast_before_weight and dtype != torch.float32 else 1
    assert_close(y, y_ref, dtype, roundings=roundings)
    if dtype != torch.float32:
        assert (y != y_ref.to(dtype)).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(6, 40000), (3, 4096)], ids=shape_id)
@pytest.mark.parametrize("sum_into", ["residual", "x"])
def test_fused_add_rms_norm_in_place(kernel, device, dtype, shape, sum_into):
    """vLLM style: one input receives the norm, the other the sum: rows long enough to
    re-read, and decode rows (CUDA: the residual row kernel, which stores the sum before its
    reduction)."""
    x, res = make(shape, dtype, device), make(shape, dtype, device)
    w = make(shape[-1:], dtype, device)
    h_ref = (x.double() + res.double()).to(dtype)
    y_ref = rms_norm_ref(h_ref, w, 1e-6)
    out, residual_out = (x, res) if sum_into == "residual" else (res, x)
    y, h = kernel.fused_add_rms_norm(x, res, w, 1e-6, out=out, residual_out=residual_out)
    assert y is out and h is residual_out
    assert torch.equal(residual_out, h_ref)
    assert_close(out, y_ref, dtype)


def test_fused_add_rms_norm_over_the_weight(kernel, device):
    """One row (a 1-D input) may write its norm over the weight it reads (each element's
    weight is read before its write), not its sum: that would overwrite the weight before
    the norm reads it."""
    x, res = make((4096,), torch.bfloat16, device), make((4096,), torch.bfloat16, device)
    w = make((4096,), torch.bfloat16, device)
    h_ref = (x.double() + res.double()).to(torch.bfloat16)
    y_ref = rms_norm_ref(h_ref, w, 1e-6)
    with pytest.raises(RuntimeError, match="residual_out and weight share memory"):
        kernel.fused_add_rms_norm(x, res, w, 1e-6, out=torch.empty_like(x), residual_out=w)
    y, h = kernel.fused_add_rms_norm(x, res, w, 1e-6, out=w, residual_out=torch.empty_like(x))
    assert y is w and torch.equal(h, h_ref)
    assert_close(w, y_ref, torch.bfloat16)


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "x_shape, mod_shape",
    [((2, 77, 512), (2, 512)), ((2, 77, 512), (2, 1, 512)), ((2, 77, 512), (2, 77, 512)),
     ((3, 5, 2048), (512 * 4,)), ((4, 1000), (4, 1000)), ((2, 9, 1001), (2, 1, 1001)),
     ((1, 3, 65536), (1, 65536)), ((2, 4300, 2048), (2, 1, 2048)), ((2, 4300, 128), (2, 1, 128)),
     ((2, 40, 1536), (2, 1, 1536)), ((2, 40, 1536), (2, 40, 1536)), ((2, 4300, 1024), (2, 1, 1024)),
     ((2, 40, 6144), (2, 1, 6144)), ((2, 40, 3072), (2, 1, 3072))],
    # many_rows: LTX's row width with enough rows (64 per SM up to 134 SMs) for the
    # four-vector launch on CUDA; many_narrow_rows: as many rows of 16 vectors in 16 bits,
    # which take two vectors a thread at any batch. The other shapes have too few rows.
    # ragged_*: rows of 192 vectors on 128 threads (the two-vector launch), half of the
    # threads without a second vector. many_rows_d1024: as many rows of 128 vectors (two
    # vectors a thread at any batch for AdaLN RMS in 16 bits on sm_90, four otherwise). ragged_wide: 768
    # vectors in 16 bits on the two-vector launch's 512 threads; ragged_wide_fp32: as many
    # in fp32 (384 on 256 threads in 16 bits).
    ids=["per_batch", "per_batch_3d", "per_token", "shared", "2d", "odd_d", "long_rows", "many_rows",
         "many_narrow_rows", "ragged_per_batch", "ragged_per_token", "many_rows_d1024", "ragged_wide",
         "ragged_wide_fp32"],
)
@pytest.mark.kernels_ci
def test_adaln(kernel, device, x_shape, mod_shape, dtype, norm):
    x = make(x_shape, dtype, device, scale=2.0) + 0.5  # an offset mean: LayerNorm must centre
    scale = make(mod_shape, dtype, device, scale=0.3)
    shift = make(mod_shape, dtype, device, scale=0.3)
    y = kernel.adaln(x, scale, shift, 1e-6, norm=norm)
    assert_close(y, adaln_ref(x, scale, shift, 1e-6, norm), dtype, atol=1e-4)


# On CUDA, rows of D = 256 share 128-thread blocks; rows of 2048 take a block each.
@pytest.mark.parametrize("d", [256, 2048])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_adaln_takes_chunked_views(kernel, device, norm, d):
    """scale/shift as emb.chunk(6, -1) views (batch stride 6D): no copy, same result."""
    b, s = 2, 33
    x = make((b, s, d), torch.bfloat16, device)
    emb = make((b, 6 * d), torch.bfloat16, device, scale=0.3)
    shift, scale = emb.chunk(6, dim=-1)[:2]
    assert not scale.is_contiguous()
    y = kernel.adaln(x, scale, shift, 1e-6, norm=norm)
    assert_close(y, adaln_ref(x, scale.contiguous(), shift.contiguous(), 1e-6, norm), torch.bfloat16, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gate", ["per_batch", "per_batch_3d", "per_token"])
# On CUDA: 302, the looping kernel element by element (302 takes no 16-byte vectors); 150 x 2
# rows of 2048 and 1 x 2 of 16384 (a row over 8 blocks, 16 in fp32): the lean kernel, a vector
# a thread.
@pytest.mark.parametrize("s, d", [(50, 302), (150, 2048), (1, 16384)])
def test_gated_residual(kernel, device, s, d, gate, dtype):
    res, x = make((2, s, d), dtype, device), make((2, s, d), dtype, device)
    gate = make({"per_batch": (2, d), "per_batch_3d": (2, 1, d), "per_token": (2, s, d)}[gate], dtype, device)
    h = kernel.gated_residual(res, x, gate)
    expected = gated_residual_ref(res, x, gate)
    # fp32 fma then one rounding vs the exact value rounded: ties can differ by one ulp.
    assert_close(h, expected, dtype)


def test_gated_residual_past_one_pass_of_the_grid(kernel, device):
    """65537 rows of 2048: past the 65535 rows of 256-thread blocks one pass of the CUDA grid
    covers, so the looping kernel (16-byte vectors) takes them; the rows of its second pass
    checked."""
    if device == "cpu":
        pytest.skip("the CUDA launch's grid bound; the CPU twin has none")
    rows, d = 65537, 2048
    res, x = make((1, rows, d), torch.bfloat16, device), make((1, rows, d), torch.bfloat16, device)
    gate = make((1, 1, d), torch.bfloat16, device)
    h = kernel.gated_residual(res, x, gate)
    for part in (slice(0, 2), slice(rows - 3, rows)):  # a full fp64 reference would take 2 GB
        assert_close(h[:, part], gated_residual_ref(res[:, part], x[:, part], gate), torch.bfloat16)


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# (8500, 64): 17000 rows, over 128 per SM on an H200 or A100: one vector a thread for both
# norms at a large batch (LayerNorm kept four there until the one-vector rows without a
# weight ran a full SM: norm_forward.cuh, kOneVecUnweightedMinBlocks).
@pytest.mark.kernels_ci
@pytest.mark.parametrize("s, d", [(7, 256), (7, 2048), (7, 1001), (7, 40000), (701, 2048), (150, 1000), (8500, 64)])
def test_gated_residual_adaln(kernel, device, s, d, dtype, norm):
    b = 2
    res, x = make((b, s, d), dtype, device), make((b, s, d), dtype, device)
    gate = make((b, d), dtype, device)
    scale, shift = make((b, 1, d), dtype, device, scale=0.3), make((b, 1, d), dtype, device, scale=0.3)
    h, y = kernel.gated_residual_adaln(res, x, gate, scale, shift, 1e-6, norm=norm)
    h_ref = gated_residual_ref(res, x, gate)
    assert_close(h, h_ref, dtype)
    # The norm is of the rounded residual the kernel stored, as the host normalises it.
    assert_close(y, adaln_ref(h, scale, shift, 1e-6, norm), dtype, atol=1e-4)


# The lean kernel's layouts, every op of the norm family in 16 bits (inputs [2, rows, D]):
# rows of at most 64 vectors at any batch, a vector a thread, several rows to a block (100 x 128: two rows a warp; 80 x 192: lanes
# without a vector; 8194 x 256: the last block short of rows; 602 x 512: two warps a row,
# LayerNorm's a warp at two vectors a thread; 66 x 504: its last lane without a second),
# and decode rows (fewer than two per SM), a block a row at one vector a thread (10 x 2568:
# the last warp partly without a vector), two (4 x 6144; 6 x 4104: most threads without a
# second vector) or four (6 x 12288). The sum may be written into the residual or the input:
# LayerNorm's lanes all read the row's first element, which the sum overwrites.
LEAN_SHAPES = [(1, 256), (50, 128), (40, 192), (4097, 256), (301, 512), (33, 504), (5, 2568), (2, 6144),
               (3, 4104), (3, 12288)]


LEAN_OPS = [(op, "new") for op in ("rms_norm", "adaln_rms", "adaln_layer")] + [
    (op, into) for op in ("fused_add_rms_norm", "gated_residual_adaln_rms", "gated_residual_adaln_layer")
    for into in ("new", "residual", "x")]


@pytest.mark.parametrize("op, sum_into", LEAN_OPS, ids="-".join)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("shape", LEAN_SHAPES, ids=shape_id)
def test_lean_rows(kernel, device, shape, dtype, op, sum_into):
    check_norm_op(kernel, device, shape, dtype, op, sum_into)


# The norm family's fp32 decode rows (two rows) that four vectors a thread of 512 threads do
# not cover, inputs [2, 1, D]: the fused ops' take up to eight a thread (norm_forward.cuh,
# kDecodeCachedVecs; after a residual add with every vector's loads first): D = 16000
# (threads 416-511 without an eighth vector), 16384 (eight each); at 16388 four re-read the
# rest.
@pytest.mark.parametrize("op, sum_into", LEAN_OPS, ids=str)
@pytest.mark.parametrize("shape", [(1, 16000), (1, 16384), (1, 16388)], ids=shape_id)
def test_fp32_decode_rows(kernel, device, shape, op, sum_into):
    check_norm_op(kernel, device, shape, torch.float32, op, sum_into)


def check_norm_op(kernel, device, shape, dtype, op, sum_into):
    """The norm family's op on inputs [2, rows, D], against the fp64 reference; the sum
    written into a new tensor, the residual or x."""
    residual_op = op.startswith(("fused", "gated"))
    rows, d = shape
    x, res = make((2, rows, d), dtype, device, scale=2.0) + 0.5, make((2, rows, d), dtype, device)
    if op in ("rms_norm", "fused_add_rms_norm"):
        w = make((d,), dtype, device)
        cast = rows % 2 == 1  # the Llama order on odd row counts
        h_ref = (x.double() + res.double()).to(dtype) if residual_op else x
        y_ref = rms_norm_ref(h_ref, w, 1e-6, cast_before_weight=cast)
        if residual_op:
            out, residual_out = ((x, res) if sum_into == "residual" else (res, x)) if sum_into != "new" else (None, None)
            y, h = kernel.fused_add_rms_norm(x, res, w, 1e-6, cast_before_weight=cast, out=out,
                                             residual_out=residual_out)
            assert torch.equal(h, h_ref)
        else:
            y = kernel.rms_norm(x, w, 1e-6, cast_before_weight=cast)
        assert_close(y, y_ref, dtype, roundings=2 if cast else 1)
        return
    norm = op.rsplit("_", 1)[1]
    scale, shift = make((2, rows, d), dtype, device, scale=0.3), make((2, 1, d), dtype, device, scale=0.3)
    if residual_op:
        gate = make((2, d), dtype, device)
        h_ref = gated_residual_ref(res, x, gate)
        y_ref = adaln_ref(h_ref, scale, shift, 1e-6, norm)
        if sum_into == "new":
            h, y = kernel.gated_residual_adaln(res, x, gate, scale, shift, 1e-6, norm=norm)
        else:
            residual_out, out = (res, x) if sum_into == "residual" else (x, res)
            h, y = kernel.gated_residual_adaln(res, x, gate, scale, shift, 1e-6, norm=norm,
                                               residual_out=residual_out, out=out)
            assert h is residual_out and y is out
        if dtype == torch.float32:  # the fp64 reference's roundings against the kernel's fp32 ones
            assert_close(h, h_ref, dtype)
        else:
            assert torch.equal(h, h_ref)
    else:
        y, y_ref = kernel.adaln(x, scale, shift, 1e-6, norm=norm), adaln_ref(x, scale, shift, 1e-6, norm)
    assert_close(y, y_ref, dtype, atol=1e-4)


# AdaLN's output is the same bits whether its forward saves the row statistics (as autograd's
# does) or not, and the statistics match fp64's, on decode rows, rows of 128-512 and rows of
# one to four vectors a thread at 512 threads (the lean kernel on CUDA), and on rows of 1024
# at two rows per SM and more (norm_kernel); fp32 decode rows of 16384 (adaln's at eight
# vectors a thread).
@pytest.mark.parametrize("op", ["adaln", "gated_residual_adaln"])
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("shape, dtype", [(shape, dtype) for dtype in LOW for shape in [
    (1, 256), (50, 128), (301, 512), (5, 2568), (2, 6144), (3, 12288), (301, 1024)]] + [((1, 16384), torch.float32)],
    ids=lambda v: str(v) if isinstance(v, torch.dtype) else shape_id(v))
def test_adaln_output_does_not_depend_on_saved_stats(kernel, device, shape, dtype, norm, op):
    rows, d = shape
    x = make((2, rows, d), dtype, device, scale=2.0) + 0.5
    scale, shift = make((2, 1, d), dtype, device, scale=0.3), make((2, 1, d), dtype, device, scale=0.3)
    residual = {}
    if op == "gated_residual_adaln":  # the rows after the gated residual
        residual = dict(residual=make((2, rows, d), dtype, device), gate=make((2, 1, d), dtype, device))
    adaln_checking_stats(kernel, x, scale, shift, 1e-6, norm, **residual)


def test_layer_norm_centres_large_means(kernel, device):
    """mean / std = 300: E[x^2] - E[x]^2 in fp32 would lose the variance to cancellation
    (errors ~0.3); the two-pass variance keeps the result within 5e-3."""
    x = (torch.randn(4, 1, 4096) + 300.0).to(device)
    zeros = torch.zeros(4096, device=device)
    y = kernel.adaln(x, zeros, zeros, 1e-6, norm="layer")
    torch.testing.assert_close(y.double(), layer_norm_ref(x, 1e-6), rtol=0, atol=5e-3)


def _bad_calls(k, device):
    f16 = dict(dtype=torch.float16, device=device)
    x = torch.randn(2, 3, 64, **f16)
    mod = torch.randn(2, 64, **f16)
    return {
        "adaln_norm_name": (lambda: k.ops.adaln(x, mod, mod, 1e-6, "batch"), r'norm must be "rms" or "layer"'),
        "adaln_scale_d": (lambda: k.adaln(x, torch.randn(2, 32, **f16), mod), "must be \\[D\\], \\[B, D\\] or \\[B, S, D\\]"),
        "adaln_scale_batch": (lambda: k.adaln(x, torch.randn(3, 64, **f16), mod), "does not broadcast to input"),
        "adaln_scale_dtype": (lambda: k.adaln(x, mod.float(), mod), "scale has dtype Float but input has dtype Half"),
        "adaln_4d_input": (lambda: k.adaln(x[None], mod, mod), r"input must be \[B, S, D\] or \[B, D\]"),
        "adaln_scale_stride": (lambda: k.adaln(x, torch.randn(2, 128, **f16)[:, ::2], mod),
                               "scale must be contiguous in its last dim"),
        "fused_add_residual_shape": (lambda: k.fused_add_rms_norm(x, torch.randn(2, 3, 32, **f16)),
                                     "residual has sizes"),
        "fused_add_residual_dtype": (lambda: k.fused_add_rms_norm(x, x.float()), "residual has dtype Float"),
        "gated_gate_shape": (lambda: k.gated_residual(x, x, torch.randn(2, 4, 64, **f16)), "does not broadcast"),
        "gated_residual_dtype": (lambda: k.gated_residual(x.float(), x, mod), "residual has dtype Float"),
        "weight_bf16_with_fp16": (lambda: k.rms_norm(x, torch.ones(64, dtype=torch.bfloat16, device=device)),
                                  "weight has dtype BFloat16 but input has dtype Half"),
    }


@pytest.mark.parametrize("case", list(_bad_calls(None, "cpu")))
def test_bad_input_raises_a_clear_error(kernel, device, case):
    call, message = _bad_calls(kernel, device)[case]
    with pytest.raises(RuntimeError, match=message):
        call()


def test_python_level_argument_errors(kernel):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="norm must be one of"):
        kernel.adaln(x, x, x, norm="group")
    with pytest.raises(ValueError, match="pass out and residual_out together"):
        kernel.fused_add_rms_norm(x, x, out=torch.empty_like(x))


def test_partly_overlapping_outputs_are_refused(kernel, device):
    buf = torch.randn(9, 64, device=device)
    x = buf[:8]
    with pytest.raises(RuntimeError, match="out partly overlaps an input"):
        kernel.rms_norm(x, None, 1e-6, out=buf[1:])
    res = torch.randn(8, 64, device=device)
    with pytest.raises(RuntimeError, match="out and residual_out share memory"):
        kernel.fused_add_rms_norm(x, res, out=res, residual_out=res)
