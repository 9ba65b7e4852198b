"""Shared glue between the functional API and torch.autograd (whose formulas are C++
kernels on the Autograd key: torch-ext/torch_autograd.cpp, which also refuses the out= and
in-place forms where autograd would need a record)."""

import torch


def records_grad(*tensors) -> bool:
    """Whether autograd would record an op on these tensors (None entries are skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
