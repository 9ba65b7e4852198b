"""The GELU family of feed-forward activations, with fake implementations for
torch.compile beside them.

Tensors are float32, float16 or bfloat16 on CPU or CUDA (float64 too on the CPU, exact
erf and tanh in double), ``[..., D]`` with a contiguous
last dim and leading dims that collapse into one row stride. Math is fp32 with one
rounding to the input dtype. ``approximate`` is ``"none"`` (erf) or ``"tanh"``, as in
``torch.nn.functional.gelu``.

Autograd: the functional forms are differentiable (one elementwise backward kernel each);
double backward and forward-mode AD raise, as do the ``out=`` forms on tensors that require grad.
"""

from typing import Optional

import torch

from ._ops import add_op_namespace_prefix, ops


def gelu(x: torch.Tensor, approximate: str = "tanh", *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.gelu(x, approximate=approximate)``; the tanh form is what LTX-Video, FLUX and
    SD3 feed-forwards use (diffusers' ``gelu-approximate``)."""
    if out is None:
        return ops.gelu(x, approximate)
    ops.gelu_out(out, x, approximate)
    return out


def gelu_mul(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``gelu(gate) * up`` from two tensors of one shape (Gemma's MLP:
    ``gelu_tanh(gate_proj(x)) * up_proj(x)``)."""
    if out is None:
        return ops.gelu_mul(gate, up, approximate)
    ops.gelu_mul_out(out, gate, up, approximate)
    return out


def geglu(x: torch.Tensor, approximate: str = "none", *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """diffusers' ``GEGLU`` on the projection's output ``x = [value | gate]`` (``[..., 2H]``):
    ``value * gelu(gate)``, returning ``[..., H]``. The gate is the second half."""
    if out is None:
        return ops.geglu(x, approximate)
    ops.geglu_out(out, x, approximate)
    return out


@torch.library.register_fake(add_op_namespace_prefix("gelu"))
def _(x, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake(add_op_namespace_prefix("gelu_mul"))
def _(gate, up, approximate):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.register_fake(add_op_namespace_prefix("geglu"))
def _(x, approximate):
    return x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,))


for _name in ("gelu_out", "gelu_mul_out", "geglu_out"):
    torch.library.register_fake(add_op_namespace_prefix(_name))(lambda *args: None)
del _name


@torch.library.register_fake(add_op_namespace_prefix("gelu_backward"))
def _(grad, x, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake(add_op_namespace_prefix("gelu_mul_backward"))
def _(grad, gate, up, approximate):
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(gate, memory_format=torch.contiguous_format))


@torch.library.register_fake(add_op_namespace_prefix("geglu_backward"))
def _(grad, x, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
