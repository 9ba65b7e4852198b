"""Layers hand every call their ops do not take to the host's forward, which then computes
it as stock does: host dtypes the ops do not mix, broadcasts the ops do not make, autograd
the ops do not support. Each case against the host module or function itself."""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from diffusers.models.normalization import AdaLayerNormZero  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb  # noqa: E402


class RotaryHost(nn.Module):
    """The host of transformers' ``rotary_pos_emb`` hook: the function as a module."""

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def test_rms_norm_layer_with_a_weight_of_the_other_16_bit_dtype(kernel, device):
    """An fp16 Llama norm fed bf16 hidden states: the host's product promotes to fp32."""
    host = LlamaRMSNorm(256, eps=1e-6).to(device=device, dtype=torch.float16)
    with torch.no_grad():
        host.weight.normal_()
    x = torch.randn(3, 5, 256, device=device, dtype=torch.bfloat16)
    expected = host(x)
    actual = kernel.layers.RMSNorm.forward(host, x)
    assert actual.dtype == expected.dtype == torch.float32
    # The host rounds the normed row to bf16 before the weight: two roundings.
    torch.testing.assert_close(actual, expected, rtol=2 * 2**-7, atol=1e-5)


def rotary_inputs(device, q_batch, k_batch, table_batch, heads=4, seq=4, dim=16, dtype=torch.float32):
    q = torch.randn(q_batch, heads, seq, dim, device=device, dtype=dtype)
    k = torch.randn(k_batch, 2, seq, dim, device=device, dtype=dtype)
    angles = torch.randn(table_batch, seq, dim // 2, device=device)
    angles = torch.cat([angles, angles], dim=-1)
    return q, k, angles.cos(), angles.sin()


@pytest.mark.parametrize("q_batch, k_batch, table_batch", [(2, 2, 1), (1, 1, 2), (2, 1, 2), (2, 1, 1)],
                         ids=["tables-broadcast", "q-and-k-broadcast", "k-broadcast", "k-and-tables-broadcast"])
def test_rotary_layer_broadcasts_as_the_host_does(kernel, device, q_batch, k_batch, table_batch):
    q, k, cos, sin = rotary_inputs(device, q_batch, k_batch, table_batch)
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    actual = kernel.layers.ApplyRotaryPosEmb.forward(RotaryHost(), q, k, cos, sin)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_rotary_layer_with_2d_tables(kernel, device, unsqueeze_dim):
    """[S, D] tables, unsqueezed, broadcast over the heads at unsqueeze_dim 1 (with as many
    heads as positions the op would compute something else without a word) and do not
    broadcast at 2: the layer does what the host does, result or error."""
    q, k, cos, sin = rotary_inputs(device, 2, 2, 1, heads=4, seq=4)
    k = torch.randn_like(q)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    cos, sin = cos[0], sin[0]
    try:
        expected = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    except RuntimeError as error:
        with pytest.raises(RuntimeError, match=str(error).split("(")[0]):
            kernel.layers.ApplyRotaryPosEmb.forward(RotaryHost(), q, k, cos, sin, unsqueeze_dim)
        return
    actual = kernel.layers.ApplyRotaryPosEmb.forward(RotaryHost(), q, k, cos, sin, unsqueeze_dim)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_batch, emb_batch", [(1, 2), (2, 1), (2, 2)])
def test_ada_layer_norm_zero_broadcasts_as_the_host_does(kernel, device, x_batch, emb_batch):
    host = AdaLayerNormZero(64, num_embeddings=None).to(device)
    with torch.no_grad():
        for p in host.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(x_batch, 7, 64, device=device)
    emb = torch.randn(emb_batch, 64, device=device)
    expected = host(x, emb=emb)
    actual = kernel.layers.AdaLayerNormZero.forward(host, x, emb=emb)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_layer_under_forward_mode_ad_computes_with_the_host(kernel, device):
    """The ops refuse dual tensors; a layer then computes with the host's code, whose
    tangent is the host's own."""
    host = LlamaRMSNorm(128).to(device)
    with torch.no_grad():
        host.weight.normal_()
    x, tangent = torch.randn(4, 128, device=device), torch.randn(4, 128, device=device)
    expected = torch.func.jvp(host, (x,), (tangent,))
    actual = torch.func.jvp(lambda h: kernel.layers.RMSNorm.forward(host, h), (x,), (tangent,))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="rms_norm: forward-mode AD"):
        torch.func.jvp(lambda h: kernel.rms_norm(h, host.weight, 1e-6), (x,), (tangent,))
