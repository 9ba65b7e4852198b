"""Autograd: the gradients of every differentiable op match the fp64 autograd of the
reference math (tests/reference.py), on every (variant, device) target and dtype. Shapes
cover the CUDA backward's paths: vector and scalar rows, rows split into column slices,
many row blocks (partial column sums), per-row and broadcast modulation."""

import pytest
import torch
import torch.nn.functional as F

from reference import adaln_checking_stats, adaln_ref, rms_norm_ref, rope_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Worst error of a grad vs the fp64 reference, relative to the reference's largest
# magnitude: one rounding of every input and of the grad itself, plus fp32 sums.
GRAD_RTOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _leaves(device, dtype, *shapes):
    return [torch.randn(*s, device=device, dtype=dtype).requires_grad_() for s in shapes]


def _assert_grads_match(ours, reference, inputs, dtype):
    """Backprop the same random cotangents through both; compare the grads of `inputs`."""
    ours = ours if isinstance(ours, tuple) else (ours,)
    cotangents = [torch.randn_like(o) for o in ours]
    got = torch.autograd.grad(ours, inputs, cotangents)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    ref = reference(*inputs64)
    ref = ref if isinstance(ref, tuple) else (ref,)
    expected = torch.autograd.grad(ref, inputs64, [c.double() for c in cotangents])
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == inputs[i].dtype and g.shape == inputs[i].shape, (i, g.dtype, g.shape)
        _assert_grad_close(g, e, dtype, f"grad {i}")


def _assert_grad_close(got, expected, dtype, what):
    err = (got.double() - expected).abs().max().item()
    bound = GRAD_RTOL[dtype] * max(expected.abs().max().item(), 1e-3)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


# Rows split into column slices (on sm_90 a cluster's blocks, up to 8): 12288 is 2 slices of
# 16-bit rows, 40000 is 5 (10 in fp32, whose blocks re-read the row), with several rows per
# cluster; 65536 is 8 (16 in fp32).
RMS_SHAPES = [(3, 5, 64), (3000, 64), (4, 4100), (2, 12288), (160, 40000), (40, 65536)]


@pytest.mark.kernels_ci
@pytest.mark.parametrize("shape", RMS_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_grads(kernel, device, shape, dtype):
    x, w = _leaves(device, dtype, shape, shape[-1:])
    _assert_grads_match(kernel.rms_norm(x, w, 1e-6), lambda x, w: rms_norm_ref(x, w, 1e-6), [x, w], dtype)


@pytest.mark.parametrize("cols", [256, 5000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_grads_fp32_weight_and_out(kernel, device, dtype, cols):
    """The Llama order with an fp32 weight: grads of an fp32 output, to an fp32 weight.
    fp32 grads of a 16-bit input take half the columns per CUDA slice: 5000 is two."""
    (x,) = _leaves(device, dtype, (6, cols))
    w = torch.randn(cols, device=device).requires_grad_()
    y = kernel.rms_norm(x, w, 1e-6, cast_before_weight=True, out_dtype=torch.float32)
    _assert_grads_match(y, lambda x, w: rms_norm_ref(x, w, 1e-6), [x, w], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_grads_without_weight_and_with_offset(kernel, device, dtype):
    x, w = _leaves(device, dtype, (9, 96), (96,))
    _assert_grads_match(kernel.rms_norm(x, None, 1e-5), lambda x: rms_norm_ref(x, None, 1e-5), [x], dtype)
    y = kernel.rms_norm(x, w, 1e-5, weight_offset=1.0)
    _assert_grads_match(y, lambda x, w: rms_norm_ref(x, w, 1e-5, weight_offset=1.0), [x, w], dtype)


# 14 rows, the residual's grad added to the input's: narrow (on CUDA one block of the wider
# layout holds them all) and a block a row of 256 or 512 vectors (16-bit; fp32 at 2048).
@pytest.mark.kernels_ci
@pytest.mark.parametrize("cols", [128, 2048, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_grads(kernel, device, cols, dtype):
    x, r, w = _leaves(device, dtype, (2, 7, cols), (2, 7, cols), (cols,))

    def reference(x, r, w):
        h = x + r
        return rms_norm_ref(h, w, 1e-6), h

    _assert_grads_match(kernel.fused_add_rms_norm(x, r, w, 1e-6), reference, [x, r, w], dtype)


MOD_SHAPES = {"per-batch": (2, 1, 64), "per-batch-2d": (2, 64), "shared": (64,), "per-token": (2, 300, 64),
              "per-token-shared-by-batch": (1, 300, 64)}


@pytest.mark.kernels_ci
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("mod", list(MOD_SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adaln_grads(kernel, device, norm, mod, dtype):
    x, scale, shift = _leaves(device, dtype, (2, 300, 64), MOD_SHAPES[mod], MOD_SHAPES[mod])
    y = kernel.adaln(x, scale, shift, 1e-6, norm=norm)
    _assert_grads_match(y, lambda x, s, t: adaln_ref(x, s, t, 1e-6, norm), [x, scale, shift], dtype)


# One row per batch entry ([B, D] or [B, 1, D]): the backward takes the rows as tokens of
# one group, with a per-row or a shared operand.
ROW_INPUTS = [((300, 64), (300, 64)), ((300, 64), (64,)), ((300, 64), (1, 64)), ((300, 1, 64), (300, 1, 64)),
              ((300, 1, 64), (300, 64)), ((300, 1, 64), (1, 1, 64)), ((0, 64), (64,)), ((2, 0, 64), (2, 1, 64))]


@pytest.mark.parametrize("x_shape, mod_shape", ROW_INPUTS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adaln_grads_one_row_per_batch_entry(kernel, device, x_shape, mod_shape, dtype):
    x, scale, shift = _leaves(device, dtype, x_shape, mod_shape, mod_shape)
    y = kernel.adaln(x, scale, shift, 1e-6, norm="layer")
    grads = torch.autograd.grad(y, [x, scale, shift], torch.ones_like(y))
    assert [g.shape for g in grads] == [x.shape, scale.shape, shift.shape]
    if x.numel() == 0:
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
        return
    _assert_grads_match(kernel.adaln(x, scale, shift, 1e-6, norm="layer"),
                        lambda x, s, t: adaln_ref(x, s, t, 1e-6, "layer"), [x, scale, shift], dtype)


@pytest.mark.parametrize("scale_mod, shift_mod", [("per-token", "per-batch"), ("per-batch", "per-token")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adaln_grads_mixed_modulation(kernel, device, scale_mod, shift_mod, dtype):
    """One column grad summed, the other per row: the column-sum launch takes either alone."""
    x, scale, shift = _leaves(device, dtype, (2, 300, 64), MOD_SHAPES[scale_mod], MOD_SHAPES[shift_mod])
    y = kernel.adaln(x, scale, shift, 1e-6, norm="rms")
    _assert_grads_match(y, lambda x, s, t: adaln_ref(x, s, t, 1e-6, "rms"), [x, scale, shift], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adaln_grads_wide_rows_and_chunk_views(kernel, device, dtype):
    """Rows wider than one CUDA slice; scale/shift as strided chunks of one embedding."""
    (x,) = _leaves(device, dtype, (2, 3, 9000))
    emb = torch.randn(2, 1, 2 * 9000, device=device, dtype=dtype).requires_grad_()
    scale, shift = emb.chunk(2, dim=-1)
    y = kernel.adaln(x, scale, shift, 1e-6, norm="layer")
    _assert_grads_match(y, lambda x, e: adaln_ref(x, *e.chunk(2, dim=-1), 1e-6, "layer"), [x, emb], dtype)


def _gated_residual_adaln_ref(norm):
    def reference(r, x, gate, scale, shift):
        h = r + x * gate
        return h, adaln_ref(h, scale, shift, 1e-6, norm)

    return reference


@pytest.mark.kernels_ci
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_residual_adaln_grads(kernel, device, norm, dtype):
    r, x, gate, scale, shift = _leaves(device, dtype, (2, 40, 64), (2, 40, 64), (2, 1, 64), (2, 64), (2, 64))
    ours = kernel.gated_residual_adaln(r, x, gate, scale, shift, 1e-6, norm=norm)
    _assert_grads_match(ours, _gated_residual_adaln_ref(norm), [r, x, gate, scale, shift], dtype)


# The forwards autograd calls for AdaLN also store each row's mean and rstd; the backward
# reads them (one row reduction fewer) or, called without them, computes them. Both match
# the fp64 reference, on rows sharing a CUDA block (2048 16-bit / 1024 fp32 columns), the
# scalar path (509) and rows split into column slices (9000); the input's mean is far from 0.
# Few rows (2 x 5, at most one an SM): on CUDA a block a row at 2048 / 1024 columns, and at
# 255 vectors ("ragged": the block's last thread past the row end joins the row sums).
@pytest.mark.parametrize("op", ["adaln", "gated_residual_adaln"])
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("cols", ["sharing", "ragged", 509, 9000])
@pytest.mark.parametrize("tokens", [301, 5], ids=["many", "few"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adaln_backward_with_and_without_saved_stats(kernel, device, op, norm, cols, tokens, dtype):
    wide = {"sharing": 2048, "ragged": 2040}
    cols = (wide[cols] // 2 if dtype == torch.float32 else wide[cols]) if cols in wide else cols
    shape, per_batch = (2, tokens, cols), (2, 1, cols)

    def randn(*size):
        return torch.randn(*size, device=device, dtype=dtype)

    x, scale, shift = randn(shape) * 2 + 3, randn(per_batch), randn(per_batch)
    residual = dict(residual=randn(shape), gate=randn(per_batch)) if op == "gated_residual_adaln" else {}
    normed, stats = adaln_checking_stats(kernel, x, scale, shift, 1e-6, norm, **residual)

    grad_out = randn(shape)
    inputs64 = [t.double().requires_grad_() for t in (normed, scale, shift)]
    expected = torch.autograd.grad(adaln_ref(*inputs64, 1e-6, norm), inputs64, grad_out.double())
    for saved in (None, stats):
        got = kernel.ops.adaln_backward(grad_out, normed, scale, shift, 1e-6, norm, None, saved)
        for name, g, e in zip(("input", "scale", "shift"), got, expected):
            _assert_grad_close(g, e, dtype, f"grad of {name}, {'saved' if saved is not None else 'no'} stats")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_adaln_backward_saved_stats_mean_far_from_zero(kernel, device, dtype):
    """Given saved statistics, the CUDA backward takes LayerNorm's sum(dn * (x - mean)) as
    sum(dn * x) - mean * sum(dn), whose rounding grows with |mean| / std: 100 here."""
    shape, per_batch = (2, 301, 2048), (2, 1, 2048)
    x = torch.randn(shape, device=device, dtype=dtype) + 100
    scale, shift = (torch.randn(per_batch, device=device, dtype=dtype) for _ in range(2))
    stats = kernel.ops.adaln_with_stats(x, scale, shift, 1e-6, "layer")[1]
    grad_out = torch.randn_like(x)
    inputs64 = [t.double().requires_grad_() for t in (x, scale, shift)]
    expected = torch.autograd.grad(adaln_ref(*inputs64, 1e-6, "layer"), inputs64, grad_out.double())
    got = kernel.ops.adaln_backward(grad_out, x, scale, shift, 1e-6, "layer", None, stats)
    for name, g, e in zip(("input", "scale", "shift"), got, expected):
        _assert_grad_close(g, e, dtype, f"grad of {name}")


def test_adaln_backward_refuses_bad_stats(kernel, device):
    x, mod = torch.randn(2, 5, 64, device=device), torch.randn(2, 1, 64, device=device)
    good = torch.stack([torch.zeros(2, 5, device=device), torch.ones(2, 5, device=device)], -1)
    kernel.ops.adaln_backward(x, x, mod, mod, 1e-6, "layer", None, good)
    bad = {"dtype": good.bfloat16(), "sizes": good[..., :1], "strides": torch.zeros(2, 5, 4, device=device)[..., ::2],
           "alignment": torch.zeros(21, device=device)[1:].view(2, 5, 2)}
    for why, stats in bad.items():
        with pytest.raises(RuntimeError, match=r"adaln_backward: stats must be"):
            kernel.ops.adaln_backward(x, x, mod, mod, 1e-6, "layer", None, stats)


def test_forwards_with_stats_refuse_a_0dim_input(kernel, device):
    """The forwards that autograd calls size their row statistics from the input: a 0-dim
    input (which has no rows) is refused as the plain forwards refuse it, not a crash."""
    s = torch.tensor(1.0, device=device)
    calls = {"adaln": lambda x: kernel.adaln(x.requires_grad_(), s, s),
             "gated_residual_adaln": lambda x: kernel.gated_residual_adaln(s, x.requires_grad_(), s, s, s),
             "adaln_with_stats": lambda x: kernel.ops.adaln_with_stats(x, s, s, 1e-6, "rms"),
             "gated_residual_adaln_with_stats":
                 lambda x: kernel.ops.gated_residual_adaln_with_stats(s, x, s, s, s, 1e-6, "layer")}
    for name, call in calls.items():
        op = "adaln" if name.startswith("adaln") else "gated_residual"
        with pytest.raises(RuntimeError, match=rf"^{op}: input must have at least 1 dim \(the one normalised\), "
                                               "got a 0-dim tensor$"):
            call(torch.tensor(1.0, device=device))


# (input, gate) shapes over the backward's paths: per-batch, shared and per-token gates,
# a per-token gate shared by the batch; B = 1 and S = 1 (a row per input row); [B, D]
# input, with many rows and a shared gate (one group of column sums); many rows per batch
# entry (partial column sums); rows wider than one CUDA slice, with a per-token gate too;
# an odd width (the scalar path); few rows a block each on CUDA (a gate per batch entry, per
# token, shared), one a ragged width (255 vectors in 16 bits); decode steps' gates of a row
# per input row, 16-byte vectors and the scalar path.
GATED_SHAPES = [((2, 10, 64), (2, 1, 64)), ((2, 10, 64), (2, 64)), ((2, 10, 64), (64,)), ((2, 10, 64), (2, 10, 64)),
                ((2, 10, 64), (1, 10, 64)), ((1, 10, 64), (1, 1, 64)), ((2, 1, 64), (2, 64)),
                ((3, 64), (3, 64)), ((3, 64), (64,)), ((3000, 64), (1, 64)), ((2, 3000, 64), (2, 1, 64)),
                ((2, 3, 9000), (2, 1, 9000)), ((2, 3, 9000), (2, 3, 9000)), ((2, 300, 65), (65,)),
                ((2, 4, 2048), (2, 1, 2048)), ((1, 3, 2040), (1, 3, 2040)), ((2, 16, 512), (512,)),
                ((8, 1, 2048), (8, 1, 2048)), ((4, 1, 509), (4, 1, 509))]


# Rows on 64 CUDA threads (as vectors: 2048 16-bit or 1024 fp32 columns, and 1024 columns
# when a 16-bit input gets fp32 grads; 509 columns on the scalar path): with column sums,
# such rows share a block, up to four, each reducing over its own warps. 301 rows per batch
# entry leave the last block of a walk part-empty. Also the extra grad (the residual's, in
# gated_residual_adaln) and a per-token scale beside a summed shift.
SHARING_OPS = ["rms_norm", "rms_norm_fp32_out", "adaln_rms", "adaln_layer", "adaln_per_token_scale",
               "gated_residual", "gated_residual_adaln"]


@pytest.mark.parametrize("op", SHARING_OPS)
@pytest.mark.parametrize("path", ["vector", "scalar"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grads_of_rows_sharing_a_block(kernel, device, op, path, dtype):
    wide = dtype != torch.float32 and op != "rms_norm_fp32_out"
    _check_grads_of_rows(kernel, device, op, dtype, 509 if path == "scalar" else 2048 if wide else 1024)


# Rows on 128 CUDA threads with one or two column grads (4096 16-bit or 2048 fp32 columns,
# 2048 when a 16-bit input gets fp32 grads) pair up in a block; 301 rows per batch entry
# leave the last pair half-empty.
@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_fp32_out", "gated_residual", "adaln_rms", "adaln_layer",
                                "adaln_per_token_scale"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grads_of_128_thread_rows_sharing_a_block(kernel, device, op, dtype):
    wide = dtype != torch.float32 and op != "rms_norm_fp32_out"
    _check_grads_of_rows(kernel, device, op, dtype, 4096 if wide else 2048)


# One or two rows per batch entry: one row block per entry, which writes the column grads
# itself (16-bit ones rounded there) rather than partial rows for column_sum_kernel.
@pytest.mark.parametrize("op", SHARING_OPS)
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grads_of_one_row_block(kernel, device, op, tokens, dtype):
    wide = dtype != torch.float32 and op != "rms_norm_fp32_out"
    _check_grads_of_rows(kernel, device, op, dtype, 4096 if wide else 2048, tokens)


# Few rows (at most one an SM): on CUDA a thread takes one vector and a row of up to 512
# vectors a block ("vector"); on sm_90 a row of 1024 ("wide") or 2048 ("wider") a cluster of
# eight row slices of 128 or 256 threads (elsewhere the wider layout), unless the group's
# rows would otherwise share one block. Groups of 3-130 rows (a batch entry of 3-65 tokens;
# rms_norm's group is the whole batch of two), at two to four rows a block of the wider
# layout and past them; an odd width (the scalar path, which keeps that layout).
@pytest.mark.parametrize("op", SHARING_OPS)
@pytest.mark.parametrize("tokens", [3, 4, 16, 17, 64, 65])
@pytest.mark.parametrize("path", ["vector", "wide", "wider", "scalar"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grads_of_few_rows(kernel, device, op, tokens, path, dtype):
    wide = dtype != torch.float32 and op != "rms_norm_fp32_out"
    cols = {"scalar": 509, "vector": 4096 if wide else 2048, "wide": 8192 if wide else 4096,
            "wider": 16384 if wide else 8192}[path]
    _check_grads_of_rows(kernel, device, op, dtype, cols, tokens)


def _check_grads_of_rows(kernel, device, op, dtype, cols, tokens=301):
    (x,) = _leaves(device, dtype, (2, tokens, cols))
    per_batch = (2, 1, cols)
    if op == "rms_norm":
        (w,) = _leaves(device, dtype, (cols,))
        _assert_grads_match(kernel.rms_norm(x, w, 1e-6), lambda x, w: rms_norm_ref(x, w, 1e-6), [x, w], dtype)
    elif op == "rms_norm_fp32_out":
        w = torch.randn(cols, device=device).requires_grad_()
        y = kernel.rms_norm(x, w, 1e-6, cast_before_weight=True, out_dtype=torch.float32)
        _assert_grads_match(y, lambda x, w: rms_norm_ref(x, w, 1e-6), [x, w], dtype)
    elif op == "gated_residual":
        r, gate = _leaves(device, dtype, x.shape, per_batch)
        _assert_grads_match(kernel.gated_residual(r, x, gate), lambda r, x, g: r + x * g, [r, x, gate], dtype)
    elif op == "gated_residual_adaln":
        r, gate, scale, shift = _leaves(device, dtype, x.shape, per_batch, per_batch, per_batch)
        ours = kernel.gated_residual_adaln(r, x, gate, scale, shift, 1e-6, norm="rms")
        _assert_grads_match(ours, _gated_residual_adaln_ref("rms"), [r, x, gate, scale, shift], dtype)
    else:
        norm = "layer" if op == "adaln_layer" else "rms"
        scale, shift = _leaves(device, dtype, x.shape if op == "adaln_per_token_scale" else per_batch, per_batch)
        y = kernel.adaln(x, scale, shift, 1e-6, norm=norm)
        _assert_grads_match(y, lambda x, s, t: adaln_ref(x, s, t, 1e-6, norm), [x, scale, shift], dtype)


@pytest.mark.parametrize("x_shape, gate_shape", GATED_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_residual_grads(kernel, device, x_shape, gate_shape, dtype):
    r, x, gate = _leaves(device, dtype, x_shape, x_shape, gate_shape)
    bcast = (lambda g: g[:, None]) if len(x_shape) == 3 and len(gate_shape) == 2 else (lambda g: g)
    _assert_grads_match(kernel.gated_residual(r, x, gate), lambda r, x, g: r + x * bcast(g), [r, x, gate], dtype)


# The gated residual's backward at few rows in all, the gate's grad summed per batch entry
# (on CUDA a thread a column vector, its rows over up to 16 row threads of four rows each, in
# at most two steps, up to 128 rows): row counts at the edges of its row threads and steps,
# one past its last (the row blocks), a gate shared by the batch (fp32 sums), and an odd
# width (the scalar path).
@pytest.mark.parametrize("batch, rows", [(2, 2), (2, 4), (2, 5), (2, 37), (2, 64), (2, 65), (1, 65), (1, 128),
                                         (1, 129)])
@pytest.mark.parametrize("cols", [2048, 509])
@pytest.mark.parametrize("shared_gate", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_residual_grads_of_few_rows(kernel, device, batch, rows, cols, shared_gate, dtype):
    gate_shape = (cols,) if shared_gate else (batch, 1, cols)
    r, x, gate = _leaves(device, dtype, (batch, rows, cols), (batch, rows, cols), gate_shape)
    _assert_grads_match(kernel.gated_residual(r, x, gate), lambda r, x, g: r + x * g, [r, x, gate], dtype)


# gated_residual_adaln's backward in one pass: the grads its two ops give, adaln_backward
# with the residual's grad as grad_extra, then gated_residual_backward on the grad that
# returns. Bit for bit on the CPU; on CUDA within the grads' tolerance, as the fused kernel
# spreads a row over twice the threads (its row sums add in another order) and its column
# sums over other blocks.
@pytest.mark.parametrize("x_shape, gate_shape", GATED_SHAPES, ids=str)
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_residual_adaln_backward_is_its_two_ops(kernel, device, x_shape, gate_shape, norm, dtype):
    def randn(shape):
        return torch.randn(shape, device=device, dtype=dtype)

    residual, x, gate, scale, shift = (randn(s) for s in (x_shape, x_shape, gate_shape, gate_shape, x_shape[-1:]))
    summed, _, stats = kernel.ops.gated_residual_adaln_with_stats(residual, x, gate, scale, shift, 1e-6, norm)
    grad_out, grad_summed = randn(x_shape), randn(x_shape)
    for saved in (None, stats):
        got = kernel.ops.gated_residual_adaln_backward(grad_out, grad_summed, summed, x, gate, scale, shift, 1e-6,
                                                       norm, saved)
        grad_residual, grad_scale, grad_shift = kernel.ops.adaln_backward(grad_out, summed, scale, shift, 1e-6, norm,
                                                                          grad_summed, saved)
        grad_input, grad_gate = kernel.ops.gated_residual_backward(grad_residual, x, gate)
        expected = (grad_residual, grad_input, grad_gate, grad_scale, grad_shift)
        for name, g, e in zip(("residual", "input", "gate", "scale", "shift"), got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape, (name, g.dtype, g.shape)
            if device == "cpu":
                assert torch.equal(g, e), name
            else:
                _assert_grad_close(g, e.double(), dtype, f"grad of {name}")


def test_gated_residual_adaln_backward_refuses_bad_inputs(kernel, device):
    x, mod = torch.randn(2, 5, 64, device=device), torch.randn(2, 1, 64, device=device)
    op = kernel.ops.gated_residual_adaln_backward
    op(x, x, x, x, mod, mod, mod, 1e-6, "rms")
    with pytest.raises(RuntimeError, match=r"gated_residual_adaln_backward: residual_out has sizes \[2, 4, 64\]"):
        op(x, x, x[:, :4], x, mod, mod, mod, 1e-6, "rms")
    with pytest.raises(RuntimeError, match=r"gated_residual_adaln_backward: grad_residual_out has dtype"):
        op(x, x.double(), x, x, mod, mod, mod, 1e-6, "rms")
    with pytest.raises(RuntimeError, match=r"gated_residual_adaln_backward: gate with sizes \[3, 1, 64\]"):
        op(x, x, x, x, torch.randn(3, 1, 64, device=device), mod, mod, 1e-6, "rms")


@pytest.mark.parametrize("gate_shape", [(2, 1, 64), (1, 0, 64), (2, 0, 64)], ids=str)
def test_gated_residual_grads_without_rows(kernel, device, gate_shape):
    r, x, gate = _leaves(device, torch.float32, (2, 0, 64), (2, 0, 64), gate_shape)
    grads = torch.autograd.grad(kernel.gated_residual(r, x, gate), [r, x, gate], torch.ones(2, 0, 64, device=device))
    assert [g.shape for g in grads] == [r.shape, x.shape, gate.shape]
    assert torch.equal(grads[2], torch.zeros_like(gate))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_residual_grads_of_views(kernel, device, dtype):
    """x a column slice of a wider projection, the gate a strided chunk of the ada values
    (as the LTX layers pass them); the gate's grad lands in the chunked tensor."""
    wide, r = _leaves(device, dtype, (2, 40, 128), (2, 40, 64))
    ada = torch.randn(2, 1, 3, 64, device=device, dtype=dtype).requires_grad_()

    def fn(r, wide, ada):
        return kernel.gated_residual(r, wide[..., 32:96], ada.unbind(2)[1])

    def reference(r, wide, ada):
        return r + wide[..., 32:96] * ada.unbind(2)[1]

    _assert_grads_match(fn(r, wide, ada), reference, [r, wide, ada], dtype)


def test_gated_residual_grad_of_input_ignores_its_value(kernel, device):
    """grad x = dy * gate does not depend on x: an infinite x leaves it finite."""
    x = torch.randn(2, 5, 64, device=device)
    x[0, 0, 0] = float("inf")
    x.requires_grad_()
    gate = torch.randn(2, 1, 64, device=device)
    dy = torch.randn(2, 5, 64, device=device)
    (grad_x,) = torch.autograd.grad(kernel.gated_residual(torch.zeros_like(dy), x, gate), x, dy)
    torch.testing.assert_close(grad_x, dy * gate, rtol=0, atol=0)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial-rotary"])
@pytest.mark.parametrize("seq", [6, 300], ids=["few-tokens", "many-tokens"])
@pytest.mark.parametrize("q_heads, k_heads", [(4, 2), (8, 4)], ids=["partial-group", "whole-groups"])
def test_rope_rotate_half_grads(kernel, device, dtype, partial, seq, q_heads, k_heads):
    """GQA q/k as transposed views of [B, S, H, D]; tables [S, R] with distinct halves (the
    backward must pair sines as the transpose does, not merely negate them). 600 tokens
    take the CUDA path of four heads per thread (head counts that are multiples of four:
    its whole-groups kernel)."""
    qs, ks = (torch.randn(2, seq, q_heads, 32, device=device, dtype=dtype),
              torch.randn(2, seq, k_heads, 32, device=device, dtype=dtype))
    q, k = qs.transpose(1, 2).requires_grad_(), ks.transpose(1, 2).requires_grad_()
    r = 16 if partial else 32
    cos, sin = torch.randn(seq, r, device=device), torch.randn(seq, r, device=device)
    rot = lambda x: rope_ref(x, cos, sin, interleaved=False)  # noqa: E731
    _assert_grads_match(kernel.rope_rotate_half(q, k, cos, sin), lambda q, k: (rot(q), rot(k)), [q, k], dtype)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_interleaved_grads(kernel, device, dtype):
    q, k = _leaves(device, dtype, (2, 12, 64), (2, 12, 64))
    cos, sin = torch.randn(2, 12, 64, device=device), torch.randn(2, 12, 64, device=device)
    rot = lambda x: rope_ref(x[:, None], cos, sin, interleaved=True)[:, 0]  # [B, S, C] as one head  # noqa: E731
    _assert_grads_match(kernel.rope_interleaved(q, k, cos, sin), lambda q, k: (rot(q), rot(k)), [q, k], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_interleaved_grads_heads_over_blocks(kernel, device, dtype):
    """25 heads of 1024 channels at one token, tables that differ within a pair: on an H100
    the pairs kernel spreads the heads over seven blocks of four rows (three rows past the
    last head) and a head's units over two blocks."""
    q, k = _leaves(device, dtype, (1, 25, 1, 1024), (1, 25, 1, 1024))  # [B, H, S, D]
    cos, sin = torch.randn(1, 1024, device=device), torch.randn(1, 1024, device=device)
    rot = lambda x: rope_ref(x, cos, sin, interleaved=True)  # noqa: E731
    _assert_grads_match(kernel.rope_interleaved(q, k, cos, sin), lambda q, k: (rot(q), rot(k)), [q, k], dtype)


def test_rope_refuses_table_grads(kernel, device):
    q, k = _leaves(device, torch.float32, (1, 4, 8), (1, 4, 8))
    cos = torch.randn(4, 8, device=device, requires_grad=True)
    q2, _ = kernel.rope_interleaved(q, k, cos, torch.randn(4, 8, device=device))
    with pytest.raises(RuntimeError, match="cos and sin"):
        q2.sum().backward()


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_norm_rope_grads(kernel, device, dtype):
    q, k, wq, wk = _leaves(device, dtype, (2, 10, 128), (2, 10, 128), (128,), (128,))
    cos, sin = torch.randn(10, 128, device=device), torch.randn(10, 128, device=device)
    rot = lambda x: rope_ref(x[:, None], cos, sin, interleaved=True)[:, 0]  # noqa: E731

    def reference(q, k, wq, wk):
        return rot(rms_norm_ref(q, wq, 1e-5)), rot(rms_norm_ref(k, wk, 1e-5))

    _assert_grads_match(kernel.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-5), reference, [q, k, wq, wk], dtype)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_grads(kernel, device, approximate, dtype):
    x, gate, up = _leaves(device, dtype, (5, 3, 66), (7, 130), (7, 130))
    _assert_grads_match(kernel.gelu(x, approximate), lambda x: F.gelu(x, approximate=approximate), [x], dtype)
    _assert_grads_match(kernel.gelu_mul(gate, up, approximate),
                        lambda g, u: F.gelu(g, approximate=approximate) * u, [gate, up], dtype)

    def geglu_ref(x):
        value, g = x.chunk(2, -1)
        return value * F.gelu(g, approximate=approximate)

    _assert_grads_match(kernel.geglu(x, approximate), geglu_ref, [x], dtype)


def test_out_forms_refuse_autograd(kernel, device):
    x, w = _leaves(device, torch.float32, (2, 8), (8,))
    with pytest.raises(RuntimeError, match="does not support autograd"):
        kernel.rms_norm(x, w, out=torch.empty(2, 8, device=device))
    with pytest.raises(RuntimeError, match="does not support autograd"):
        kernel.rope_interleaved(x[None], x[None], torch.ones(2, 8, device=device), torch.zeros(2, 8, device=device),
                                inplace=True)
    outputs = (torch.empty(1, 2, 8, device=device), torch.empty(1, 2, 8, device=device))
    with pytest.raises(RuntimeError, match="does not support autograd"):
        kernel.rope_rotate_half(x[None], x[None], torch.ones(2, 8, device=device), torch.zeros(2, 8, device=device),
                                out=outputs)
    cos = torch.ones(2, 8, device=device, requires_grad=True)  # a table that wants a grad, too
    with pytest.raises(RuntimeError, match="does not support autograd"):
        kernel.rope_rotate_half(x[None].detach(), x[None].detach(), cos, torch.zeros(2, 8, device=device), out=outputs)
    with torch.no_grad():
        kernel.rms_norm(x, w, out=torch.empty(2, 8, device=device))


def test_column_grads_are_deterministic(kernel, device):
    """The weight, scale and gate grads sum many rows: bit-identical run to run (also the
    gated residual's at few rows, on CUDA its column kernel)."""
    x, w, gate = _leaves(device, torch.bfloat16, (4096, 256), (256,), (256,))
    (few,) = _leaves(device, torch.bfloat16, (100, 256))
    g = torch.randn(4096, 256, device=device, dtype=torch.bfloat16)
    for fn, inputs in ((lambda: kernel.rms_norm(x, w, 1e-6), (x, w)),
                       (lambda: kernel.gated_residual(x, x, gate), (x, gate)),
                       (lambda: kernel.gated_residual(few, few, gate), (few, gate))):
        out = fn()
        first = torch.autograd.grad(out, inputs, g[:len(out)])
        for _ in range(3):
            again = torch.autograd.grad(fn(), inputs, g[:len(out)])
            for a, b in zip(first, again):
                assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_raw_norm_backward_ops_refuse_a_grad_out_of_another_dtype(kernel, device, dtype):
    """The backward ops are public (kernel.ops): a grad_out whose dtype is not the output's
    would be read as the input's dtype, past its buffer's end."""
    x, residual = (torch.randn(3, 5, 64, device=device, dtype=dtype) for _ in range(2))
    weight = torch.randn(64, device=device, dtype=dtype)
    gate, scale, shift = (torch.randn(3, 1, 64, device=device, dtype=dtype) for _ in range(3))
    calls = {
        "rms_norm_backward": lambda g: kernel.ops.rms_norm_backward(g, x, weight, 1e-6, 0.0, False, None),
        "adaln_backward": lambda g: kernel.ops.adaln_backward(g, x, scale, shift, 1e-6, "layer", None),
        "gated_residual_backward": lambda g: kernel.ops.gated_residual_backward(g, x, gate),
        "gated_residual_adaln_backward": lambda g: kernel.ops.gated_residual_adaln_backward(
            g, torch.zeros_like(x), residual, x, gate, scale, shift, 1e-6, "rms"),
    }
    for name, call in calls.items():
        call(torch.randn_like(x))  # the output's dtype is taken
        for other in DTYPES:
            if other != dtype:
                with pytest.raises(RuntimeError, match=rf"{name}: grad_out has dtype"):
                    call(torch.randn_like(x, dtype=other))


def test_forward_mode_transforms_raise_naming_the_op(kernel, device):
    """torch.func.jvp and jacfwd (and plain dual tensors) meet a clear error: the ops have
    no forward-mode formula, and their outputs would carry no tangent."""
    x = torch.randn(3, 16, device=device)
    with pytest.raises(NotImplementedError, match="rms_norm: forward-mode AD"):
        torch.func.jvp(lambda t: kernel.rms_norm(t, None, 1e-6), (x,), (torch.ones_like(x),))
    with pytest.raises(NotImplementedError, match="gelu: forward-mode AD"):
        torch.func.jacfwd(lambda t: kernel.gelu(t))(x)
    q = torch.randn(1, 2, 3, 8, device=device)
    cos, sin = torch.ones(3, 8, device=device), torch.zeros(3, 8, device=device)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="rope: forward-mode AD"):
            kernel.rope_interleaved(dual, q, cos, sin)


def test_writes_that_autograd_would_miss_are_seen_or_refused(kernel, device):
    """A tensor saved for a backward and then overwritten by an out= form makes that
    backward raise (its version went up); an out that requires grad, an inference-tensor
    out, and a raw in-place op on a leaf that requires grad are refused while grad mode is
    on; under torch.no_grad() the leaf update runs."""
    x = torch.randn(4, 64, device=device)
    w = torch.randn(4, 64, device=device, requires_grad=True)
    a = w * 1
    b = a.sin()  # saves a
    with torch.no_grad():
        kernel.gelu(x, out=a)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()
    with pytest.raises(RuntimeError, match="rms_norm_out: .*out requires grad"):
        kernel.rms_norm(x, None, out=torch.empty(4, 64, device=device, requires_grad=True))
    with torch.inference_mode():
        frozen = torch.empty(4, 64, device=device)
    with pytest.raises(RuntimeError, match="gelu_out: out is an inference tensor"):
        kernel.gelu(x, out=frozen)
    q = torch.randn(1, 2, 3, 8, device=device, requires_grad=True)
    k = torch.randn(1, 2, 3, 8, device=device)
    cos, sin = torch.randn(3, 8, device=device), torch.randn(3, 8, device=device)
    with pytest.raises(RuntimeError, match="rope_: .*q requires grad"):
        kernel.ops.rope_(q, k, cos, sin, False, 2)
    before = q.detach().clone()
    with torch.no_grad():
        version = q._version
        kernel.ops.rope_(q, k, cos, sin, False, 2)
    assert q._version > version and not torch.equal(q.detach(), before)
