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

from . import _checks as checks
from ._ops import ops
from ._checks import ROWS_ADVICE, refuses_nested, register_fake


@refuses_nested("gelu", ROWS_ADVICE)
def gelu(x: torch.Tensor, approximate: str = "tanh", *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.gelu(x, approximate=approximate)``; the tanh form is what LTX-Video, FLUX and
    SD3 feed-forwards use (diffusers' ``gelu-approximate``)."""
    if out is None:
        return ops.gelu(x, approximate)
    ops.gelu_out(out, x, approximate)
    return out


@refuses_nested("gelu_mul", ROWS_ADVICE)
def gelu_mul(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``gelu(gate) * up`` from two tensors of one shape (Gemma's MLP:
    ``gelu_tanh(gate_proj(x)) * up_proj(x)``)."""
    if out is None:
        return ops.gelu_mul(gate, up, approximate)
    ops.gelu_mul_out(out, gate, up, approximate)
    return out


@refuses_nested("geglu", ROWS_ADVICE)
def geglu(x: torch.Tensor, approximate: str = "none", *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """diffusers' ``GEGLU`` on the projection's output ``x = [value | gate]`` (``[..., 2H]``):
    ``value * gelu(gate)``, returning ``[..., H]``. The gate is the second half."""
    if out is None:
        return ops.geglu(x, approximate)
    ops.geglu_out(out, x, approximate)
    return out


# Fake implementations, for torch.compile, FakeTensorMode and meta tensors: the C++ checks
# (._checks, same messages), then the outputs' metadata.


def _empty_rows_like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@register_fake("gelu")
def _(device, x, approximate):
    out = _empty_rows_like(x)
    checks.activation(device, "gelu", out, x, None, approximate)
    return out


@register_fake("gelu_out")
def _(device, out, x, approximate):
    checks.activation(device, "gelu", out, x, None, approximate)


@register_fake("gelu_mul")
def _(device, gate, up, approximate):
    out = _empty_rows_like(gate)
    checks.activation(device, "gelu_mul", out, gate, up, approximate, "gate")
    return out


@register_fake("gelu_mul_out")
def _(device, out, gate, up, approximate):
    checks.activation(device, "gelu_mul", out, gate, up, approximate, "gate")


@register_fake("geglu")
def _(device, x, approximate):
    checks.check_geglu_input(x, "geglu")
    out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    checks.geglu_out(device, out, x, approximate)
    return out


@register_fake("geglu_out")
def _(device, out, x, approximate):
    checks.geglu_out(device, out, x, approximate)


@register_fake("gelu_backward")
def _(device, grad, x, approximate):
    grad_input = x.new_empty(x.shape)
    checks.activation(device, "gelu_backward", grad_input, x, None, approximate, grad=grad)
    return grad_input


@register_fake("gelu_mul_backward")
def _(device, grad, gate, up, approximate):
    grad_gate, grad_up = gate.new_empty(gate.shape), gate.new_empty(gate.shape)
    checks.activation(device, "gelu_mul_backward", grad_gate, gate, up, approximate, "gate", grad, grad_up)
    return grad_gate, grad_up


@register_fake("geglu_backward")
def _(device, grad, x, approximate):
    op = "geglu_backward"
    checks.check_geglu_input(x, op)
    grad_input = x.new_empty(x.shape)
    grad_value, grad_gate = checks.geglu_halves(grad_input)
    value, gate = checks.geglu_halves(x)
    checks.activation(device, op, grad_gate, gate, value, approximate, grad=grad, up_grad=grad_value)
    return grad_input
