"""Shared glue between the functional API and torch.autograd (whose formulas are C++
kernels on the Autograd key: torch-ext/torch_autograd.cpp)."""

import torch


def records_grad(*tensors) -> bool:
    """Whether autograd would record an op on these tensors (None entries are skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_no_grad(op: str, *tensors) -> None:
    """out= and in-place forms write into given tensors and have no backward: refuse them
    when autograd would need one, rather than return a result without a gradient."""
    if records_grad(*tensors):
        raise RuntimeError(
            f"{op}: the out= / in-place form does not support autograd; call it without out= (or under torch.no_grad())"
        )
