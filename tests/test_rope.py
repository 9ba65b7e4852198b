"""RoPE against fp64 references written as the host libraries write them: transformers'
rotate_half (GQA, transposed views, partial rotary) and diffusers' interleaved form
(LTX-Video [B, S, C] with fp32 [B, S, C] tables, FLUX per head with fp32 [S, D] tables)."""

import pytest
import torch

from reference import TOLERANCE, assert_close, rounded_norm_atol

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make(shape, dtype, device):
    return torch.randn(shape, dtype=torch.float32).to(device=device, dtype=dtype)


def tables(batch, seq, dim, dtype, device, interleaved):
    """cos/sin of real frequencies: cat(f, f) (rotate-half) or repeat_interleave (pairs)."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    pos = torch.arange(seq, dtype=torch.float64)[:, None] + torch.arange(batch, dtype=torch.float64)[:, None, None]
    f = pos * inv  # [B, S, dim / 2]
    f = f.repeat_interleave(2, -1) if interleaved else torch.cat([f, f], -1)
    return f.cos().to(device=device, dtype=dtype), f.sin().to(device=device, dtype=dtype)


def rotate_half_ref(x, cos, sin):
    """transformers: q [B, H, S, D], cos [B, S, R] -> unsqueeze(1); partial rotary."""
    r = cos.shape[-1]
    x64, c, s = x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    rot, rest = x64[..., :r], x64[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
    out = rot * c + torch.cat([-x2, x1], -1) * s
    return torch.cat([out, rest], -1)


def interleaved_ref(x, cos, sin):
    """diffusers apply_rotary_emb (use_real, unbind -1) on [..., S, D] with cos broadcast."""
    x64 = x.double()
    real, imag = x64.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], -1).flatten(-2)
    return x64 * cos.double() + rotated * sin.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch, hq, hkv, seq, d, rotary", [
    (1, 32, 8, 64, 128, 128), (2, 4, 4, 33, 64, 64), (2, 8, 2, 17, 128, 64), (1, 2, 1, 5, 80, 80), (3, 3, 1, 7, 6, 4),
    # 600+ tokens (>= 2 per SM) take a block a token on CUDA (or more), two heads a thread: 9
    # or 7 heads leave a partial pair. Where every channel rotates, the lean kernel (a
    # tensor's odd head count a last group of one); otherwise the whole-groups kernel, whose
    # blocks of at most 320 threads hold 40 heads of 128 channels (20 in fp32), or the general
    # kernel's of 512 threads 64 (32): more heads spread over two or three blocks a token.
    # 2048 channels: the lean kernel's widest head, a row of 256 threads (16-bit). Two or
    # three groups (3 or 5 heads): a token's groups in one small block, k's a group of one.
    (2, 6, 3, 300, 128, 128), (1, 6, 1, 600, 128, 96), (1, 8, 4, 640, 128, 128), (1, 48, 8, 600, 128, 128),
    (1, 61, 7, 600, 128, 128), (1, 48, 8, 600, 128, 96), (1, 2, 2, 600, 2048, 2048), (1, 2, 2, 1, 2048, 2048),
    (1, 2, 1, 601, 128, 128), (3, 4, 1, 201, 128, 128),
], ids=["gqa", "mha", "partial", "d80", "odd_tiny", "many_tokens", "many_partial", "many_whole_groups",
        "many_heads_lean", "many_heads_partial", "many_heads_whole_groups", "wide_heads", "wide_heads_decode",
        "many_tokens_few_heads", "few_heads_batched"])
@pytest.mark.kernels_ci
def test_rotate_half_matches_transformers(kernel, device, batch, hq, hkv, seq, d, rotary, dtype):
    # Transposed views, as attention modules make them: [B, S, H, D] memory, [B, H, S, D] view.
    q = make((batch, seq, hq, d), dtype, device).transpose(1, 2)
    k = make((batch, seq, hkv, d), dtype, device).transpose(1, 2)
    cos, sin = tables(batch, seq, rotary, dtype, device, interleaved=False)
    q_out, k_out = kernel.rope_rotate_half(q, k, cos, sin)
    assert q_out.shape == q.shape and q_out.stride() == q.stride(), "the output keeps q's layout"
    assert_close(q_out, rotate_half_ref(q, cos, sin), dtype, roundings=2)
    assert_close(k_out, rotate_half_ref(k, cos, sin), dtype, roundings=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["new", "in_place", "out"])
@pytest.mark.parametrize("batch, hq, hkv, seq, d, rotary", [
    (1, 5, 2, 7, 72, 72), (2, 6, 3, 300, 128, 128), (1, 5, 2, 640, 72, 64), (1, 4, 4, 640, 128, 96),
    (1, 8, 4, 640, 128, 128), (1, 1, 1, 641, 64, 64),
    # One token of heads wider than a block's units: CUDA spreads them over blocks.
    (1, 2, 1, 1, 4608, 4224),
], ids=["few_d72", "many_tokens", "many_d72_partial", "many_whole_groups_partial", "many_lean",
        "many_lean_one_head", "one_token_wide_partial"])
def test_rotate_half_distinct_table_halves(kernel, device, batch, hq, hkv, seq, d, rotary, mode, dtype):
    """Random [B, S, R] tables whose halves differ, so a kernel that takes one half's cos
    or sin for the other fails (real tables are cat(f, f): equal halves). R = 72 (R/2 = 36
    channels) gives 8-byte but not 16-byte units for 16-bit dtypes; 600+ tokens take CUDA's
    path of four heads per thread (>= 2 tokens per SM for up to 300 SMs)."""
    q = make((batch, seq, hq, d), dtype, device).transpose(1, 2)
    k = make((batch, seq, hkv, d), dtype, device).transpose(1, 2)
    cos, sin = (make((batch, seq, rotary), dtype, device) for _ in range(2))
    q_ref, k_ref = rotate_half_ref(q, cos, sin), rotate_half_ref(k, cos, sin)
    # NaN-filled: a channel the kernel leaves unwritten (the pass-through of R < D) fails.
    out = (torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))) if mode == "out" else None
    q_out, k_out = kernel.rope_rotate_half(q, k, cos, sin, inplace=mode == "in_place", out=out)
    assert (q_out is q) == (k_out is k) == (mode == "in_place")
    assert out is None or (q_out is out[0] and k_out is out[1])
    # |cos|, |sin| up to ~4 here: products of that size, so an absolute term too.
    assert_close(q_out, q_ref, dtype, roundings=2, atol=8 * TOLERANCE[dtype]["rtol"])
    assert_close(k_out, k_ref, dtype, roundings=2, atol=8 * TOLERANCE[dtype]["rtol"])


# fp32 tables with 16-bit q and k (16-byte table units on CUDA): a decode step (one head a
# thread), many tokens of even head counts (two a thread) and of odd ones (a last group of
# one).
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch, hq, hkv, seq", [(4, 32, 8, 1), (1, 8, 4, 640), (1, 6, 3, 600)],
                         ids=["decode", "many_even", "many_odd"])
def test_rotate_half_fp32_tables(kernel, device, batch, hq, hkv, seq, dtype):
    q = make((batch, seq, hq, 128), dtype, device).transpose(1, 2)
    k = make((batch, seq, hkv, 128), dtype, device).transpose(1, 2)
    cos, sin = tables(batch, seq, 128, torch.float32, device, interleaved=False)
    q_out, k_out = kernel.rope_rotate_half(q, k, cos, sin)
    assert_close(q_out, rotate_half_ref(q, cos, sin), dtype)
    assert_close(k_out, rotate_half_ref(k, cos, sin), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotate_half_shared_tables_and_in_place(kernel, device, dtype):
    q, k = make((2, 4, 9, 64), dtype, device), make((2, 2, 9, 64), dtype, device)
    cos, sin = tables(1, 9, 64, dtype, device, interleaved=False)
    cos, sin = cos[0], sin[0]  # [S, R]
    q_ref, k_ref = rotate_half_ref(q, cos[None], sin[None]), rotate_half_ref(k, cos[None], sin[None])
    q_out, k_out = kernel.rope_rotate_half(q, k, cos, sin, inplace=True)
    assert q_out is q and k_out is k
    assert_close(q, q_ref, dtype, roundings=2)
    assert_close(k, k_ref, dtype, roundings=2)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("table_dtype", ["fp32", "model"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# On CUDA, below two tokens an SM (an H100: 264) ltx, small and one_wide_token take the
# pairs kernel, ltx_prefill rope_kernel at two heads a thread, odd the unaligned path.
@pytest.mark.parametrize("batch, seq, c", [(2, 77, 2048), (2, 300, 2048), (1, 5, 64), (2, 3, 18), (1, 1, 16384)],
                         ids=["ltx", "ltx_prefill", "small", "odd", "one_wide_token"])
def test_interleaved_ltx_layout(kernel, device, batch, seq, c, dtype, table_dtype):
    """LTX: [B, S, C] q and k with [B, S, C] tables whose first C % 6 channels are padding."""
    tdtype = torch.float32 if table_dtype == "fp32" else dtype
    q, k = make((batch, seq, c), dtype, device), make((batch, seq, c), dtype, device)
    cos, sin = tables(batch, seq, c, tdtype, device, interleaved=True)
    pad = c % 6
    cos[..., :pad], sin[..., :pad] = 1, 0
    q_out, k_out = kernel.rope_interleaved(q, k, cos, sin)
    assert_close(q_out, interleaved_ref(q, cos, sin), dtype, roundings=2)
    assert_close(k_out, interleaved_ref(k, cos, sin), dtype, roundings=2)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_interleaved_flux_layout(kernel, device, sequence_dim, dtype):
    """FLUX: per head on [B, S, H, D] or [B, H, S, D], fp32 [S, D] tables."""
    b, s, h, d = 2, 40, 6, 128
    shape = (b, s, h, d) if sequence_dim == 1 else (b, h, s, d)
    q, k = make(shape, dtype, device), make(shape, dtype, device)
    cos, sin = tables(1, s, d, torch.float32, device, interleaved=True)
    cos, sin = cos[0], sin[0]
    q_out, k_out = kernel.rope_interleaved(q, k, cos, sin, sequence_dim=sequence_dim)
    c, sn = (cos[:, None], sin[:, None]) if sequence_dim == 1 else (cos, sin)
    assert_close(q_out, interleaved_ref(q, c, sn), dtype, roundings=2)
    assert_close(k_out, interleaved_ref(k, c, sn), dtype, roundings=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interleaved_unequal_heads_at_decode(kernel, device, dtype):
    """GQA heads (8 q, 2 k) at one token: on CUDA rope_kernel, as the pairs kernel takes
    equal head counts only."""
    q, k = make((1, 8, 1, 128), dtype, device), make((1, 2, 1, 128), dtype, device)
    cos, sin = tables(1, 1, 128, torch.float32, device, interleaved=True)
    q_out, k_out = kernel.rope_interleaved(q, k, cos[0], sin[0])
    assert_close(q_out, interleaved_ref(q, cos[0], sin[0]), dtype, roundings=2)
    assert_close(k_out, interleaved_ref(k, cos[0], sin[0]), dtype, roundings=2)


def test_inplace_and_out_together_are_refused(kernel, device):
    q, k = make((1, 2, 3, 8), torch.float32, device), make((1, 1, 3, 8), torch.float32, device)
    cos, sin = tables(1, 3, 8, torch.float32, device, interleaved=False)
    with pytest.raises(ValueError, match="inplace=True or out="):
        kernel.rope_rotate_half(q, k, cos, sin, inplace=True, out=(q, k))
    with pytest.raises(ValueError, match="a pair"):
        kernel.rope_rotate_half(q, k, cos, sin, out=(q,))
    for fn, args in ((kernel.rope_rotate_half, (q, k, cos, sin)), (kernel.rope_interleaved, (q, k, cos, sin)),
                     (kernel.qk_norm_rope, (q.flatten(1), k.flatten(1), None, None, cos, sin))):
        for out in ((None, None), (q, None), ([q], k)):
            with pytest.raises(TypeError, match=r"out must be a pair of tensors \(q_out, k_out\), got"):
                fn(*args, out=out)


def test_misaligned_views_take_the_scalar_path(kernel, device):
    buf = make((2 * 3 * 10 * 64 + 1,), torch.bfloat16, device)
    q = buf[1:].view(2, 3, 10, 64)
    k = make((2, 1, 10, 64), torch.bfloat16, device)
    cos, sin = tables(2, 10, 64, torch.bfloat16, device, interleaved=False)
    q_out, _ = kernel.rope_rotate_half(q, k, cos, sin)
    assert_close(q_out, rotate_half_ref(q, cos, sin), torch.bfloat16, roundings=2)
    ci, si = tables(2, 10, 64, torch.float32, device, interleaved=True)
    q_out, _ = kernel.rope_interleaved(q, k, ci, si)
    assert_close(q_out, interleaved_ref(q, ci[:, None], si[:, None]), torch.bfloat16, roundings=2)


def _bad_calls(kr, device):
    f16 = dict(dtype=torch.float16, device=device)
    q, k = torch.randn(1, 4, 8, 64, **f16), torch.randn(1, 2, 8, 64, **f16)
    cos = torch.randn(8, 64, **f16)
    return {
        "odd_rotary": (lambda: kr.rope_rotate_half(q, k, cos[:, :63], cos[:, :63]), "must be even"),
        "rotary_too_big": (lambda: kr.rope_rotate_half(q[..., :32], k[..., :32], cos, cos), "must be even and in"),
        "seq_mismatch": (lambda: kr.rope_rotate_half(q, k, cos[:4], cos[:4]), "expected \\[S, R\\] or \\[B, S, R\\]"),
        "k_head_dim": (lambda: kr.rope_rotate_half(q, k[..., :32], cos, cos), "head dim must agree"),
        "cos_sin_differ": (lambda: kr.rope_rotate_half(q, k, cos, cos.float()), "cos and sin must share"),
        "table_dtype": (lambda: kr.rope_rotate_half(q, k, cos.double(), cos.double()), "cos has dtype Double"),
        "q_2d": (lambda: kr.rope_rotate_half(q[0, 0], k[0, 0], cos, cos), "must be \\[B, S, C\\]"),
        "sequence_dim": (lambda: kr.rope_interleaved(q, k, cos, cos, sequence_dim=3), "sequence_dim must be 1"),
        "k_dtype": (lambda: kr.rope_rotate_half(q, k.float(), cos, cos), "k has dtype Float but q has dtype Half"),
        "last_dim_stride": (lambda: kr.rope_rotate_half(q.transpose(2, 3), k, cos, cos), "contiguous in its last dim"),
    }


@pytest.mark.parametrize("case", list(_bad_calls(None, "cpu")))
def test_bad_input_raises_a_clear_error(kernel, device, case):
    call, message = _bad_calls(kernel, device)[case]
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("table_layout", ["per-entry", "expanded"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# ltx_odd_tokens: 77 tokens, 154 q and k rows: a launch that packs four rows a block ends
# with a part-full block.
# On CUDA (an H100: 132 SMs) below two rows an SM, where a block holds the row, one vector a
# thread with the weight and tables preloaded (ltx_odd_tokens, small, c1000, part_full); else
# up to four vectors a thread (ltx, c1000_many_rows, one_wide_token, part_full_many_rows).
# part_full*: in 16 bits rows of 64 threads, four to a 256-thread block, the last block part
# full (154 and 602 rows).
@pytest.mark.parametrize("batch, seq, c", [(2, 77, 2048), (1, 77, 2048), (1, 3, 64), (3, 5, 1000), (2, 300, 1000),
                                           (1, 1, 8192), (1, 77, 512), (1, 301, 2048)],
                         ids=["ltx", "ltx_odd_tokens", "small", "c1000", "c1000_many_rows", "one_wide_token",
                              "part_full", "part_full_many_rows"])
@pytest.mark.kernels_ci
def test_qk_norm_rope_matches_the_ltx_prologue(kernel, device, batch, seq, c, dtype, table_layout):
    """norm_q / norm_k (torch.nn.RMSNorm over C, eps 1e-5, output rounded), then the
    interleaved RoPE with fp32 [B, S, C] tables: one per batch entry, or one expanded over
    the batch (stride 0, as the LTXVideoRotaryPosEmbed layer returns them; the CUDA kernel
    then orders its rows token-major)."""
    q, k = make((batch, seq, c), dtype, device), make((batch, seq, c), dtype, device)
    wq, wk = make((c,), dtype, device), make((c,), dtype, device)
    if table_layout == "per-entry":
        cos, sin = tables(batch, seq, c, torch.float32, device, interleaved=True)
    else:
        cos, sin = (t.expand(batch, -1, -1) for t in tables(1, seq, c, torch.float32, device, interleaved=True))
    q_out, k_out = kernel.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-5)
    for x, w, out in ((q, wq, q_out), (k, wk, k_out)):
        normed = torch.nn.functional.rms_norm(x.double(), (c,), w.double(), 1e-5).to(dtype)
        assert_close(out, interleaved_ref(normed, cos, sin), dtype, roundings=3, atol=rounded_norm_atol(normed, dtype))


def test_qk_norm_rope_from_a_fused_qkv_projection_in_place(kernel, device):
    b, s, c = 2, 9, 256
    qkv = make((b, s, 3 * c), torch.bfloat16, device)
    q, k = qkv[..., :c], qkv[..., c:2 * c]
    w = make((c,), torch.bfloat16, device)
    cos, sin = tables(1, s, c, torch.float32, device, interleaved=True)
    cos, sin = cos[0], sin[0]  # [S, C]
    normed = [torch.nn.functional.rms_norm(x.double(), (c,), w.double(), 1e-5).to(torch.bfloat16) for x in (q, k)]
    expected = [interleaved_ref(n, cos, sin) for n in normed]
    v_before = qkv[..., 2 * c:].clone()
    kernel.qk_norm_rope(q, k, w, w, cos, sin, 1e-5, out=(q, k))
    for actual, ref, n in zip((q, k), expected, normed):
        assert_close(actual, ref, torch.bfloat16, roundings=3, atol=rounded_norm_atol(n, torch.bfloat16))
    assert torch.equal(qkv[..., 2 * c:], v_before), "v untouched"


def test_qk_norm_rope_bad_input(kernel, device):
    f16 = dict(dtype=torch.float16, device=device)
    q = torch.randn(1, 4, 64, **f16)
    w = torch.ones(64, **f16)
    cos = torch.ones(4, 64, dtype=torch.float32, device=device)
    with pytest.raises(RuntimeError, match="q must be \\[B, S, C\\]"):
        kernel.qk_norm_rope(q[0], q[0], w, w, cos, cos)
    with pytest.raises(RuntimeError, match="k_weight must be a contiguous \\[64\\]"):
        kernel.qk_norm_rope(q, q, w, w[:32], cos, cos)
    with pytest.raises(RuntimeError, match="cos's last dim must be C = 64"):
        kernel.qk_norm_rope(q, q, w, w, cos[:, :32], cos[:, :32])
    with pytest.raises(RuntimeError, match="C must be even"):
        kernel.qk_norm_rope(q[..., :63], q[..., :63], w[:63], w[:63], cos[:, :63], cos[:, :63])


def test_empty_inputs(kernel, device):
    q, k = torch.empty(2, 0, 5, 64, device=device), torch.empty(2, 0, 5, 64, device=device)
    cos = torch.ones(5, 64, device=device)
    q_out, k_out = kernel.rope_rotate_half(q, k, cos, cos)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    q3 = torch.empty(0, 5, 64, device=device)
    assert kernel.qk_norm_rope(q3, q3, cos[0], cos[0], cos, cos)[0].shape == q3.shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b, s", [(2, 5), (2, 150)], ids=["decode", "many_rows"])  # CUDA: preloading or not
def test_qk_norm_rope_unaligned_rows(kernel, device, dtype, b, s):
    """An odd row stride (slice of a [B, S, C + 1] tensor): rows are not even 4-byte aligned."""
    c = 64
    q = make((b, s, c + 1), dtype, device)[..., :c]
    k = make((b, s, c + 1), dtype, device)[..., 1:]
    w = make((c,), dtype, device)
    cos, sin = tables(b, s, c, torch.float32, device, interleaved=True)
    q_out, k_out = kernel.qk_norm_rope(q, k, w, w, cos, sin, 1e-5)
    for x, out in ((q, q_out), (k, k_out)):
        normed = torch.nn.functional.rms_norm(x.double(), (c,), w.double(), 1e-5).to(dtype)
        assert_close(out, interleaved_ref(normed, cos, sin), dtype, roundings=3, atol=rounded_norm_atol(normed, dtype))


def test_outputs_that_overlap_are_refused(kernel, device):
    q, k = make((1, 1, 8, 64), torch.float32, device), make((1, 1, 8, 64), torch.float32, device)
    cos, sin = tables(1, 8, 64, torch.float32, device, interleaved=False)
    with pytest.raises(RuntimeError, match="q_out has elements that share memory"):
        kernel.rope_rotate_half(q.expand(1, 4, 8, 64), k, cos, sin, inplace=True)
    with pytest.raises(RuntimeError, match="q_out and k_out share memory"):
        kernel.ops.rope_out(q, q, q, k, cos, sin, False, 2)
