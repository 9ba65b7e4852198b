"""DTensor sharding rules for every op of this build (``torch.distributed.tensor``'s
``register_sharding``), so that the ops run on DTensors: sequence parallelism (torch's
``SequenceParallel``, transformers' ``sequence_parallel`` style), norms between tensor-parallel
projections, FSDP2's unsharded compute.

The rules never move data: every op accepts the placements its DTensor inputs already have
when they are sharded on a leading (row) dim, and the row ops keep the normalised last dim
whole (a DTensor sharded there is gathered by DTensor first, as for any op that reduces over
a dim). Pointwise ops (the GELUs, the gated residual) also take their last dim sharded.
Modulation tensors (AdaLN scale and shift, gates, RoPE tables) follow the input where they
have that dim and are replicated where they broadcast over it; the grads of weights,
scales, shifts and gates that broadcast over a sharded dim come back ``Partial`` (each rank
holds its rows' sum), as DTensor's own norms return them.

The op namespace is the build's own, so only the package can register these. It does so at
import when ``torch.distributed.tensor`` is already imported, and otherwise as soon as it
is (an import hook; importing it costs about 0.4 s, which a process that never uses
DTensors should not pay).
"""

import importlib.abc
import importlib.util
import logging
import sys
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ._ops import ops

__all__ = ["RULES", "register"]

_DTENSOR_MODULE = "torch.distributed.tensor"

# A placement list per strategy: (output placements, input placements), one entry per
# output and per argument of the op's schema (None for non-tensor and absent arguments).
Strategy = Tuple[list, list]


def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Partial, Replicate, Shard


def _rep(spec):
    """Replicate() for a tensor argument, None for an absent one."""
    _, Replicate, _ = _placements()
    return None if spec is None else Replicate()


def _following(spec, dim: int):
    """The placement of a modulation operand (AdaLN scale/shift, gate: ``[D]``, ``[B', D]``
    or ``[B', S', D]``, its leading dims aligned with the input's from the left) when the
    input is sharded on its leading ``dim``: sharded alike where it has that dim, else
    replicated (it broadcasts). Returns (operand placement, its grad's placement)."""
    Partial, Replicate, Shard = _placements()
    if dim < spec.ndim - 1 and spec.shape[dim] != 1:
        return Shard(dim), Shard(dim)
    return Replicate(), Partial()


def _last_dim_following(spec):
    """A modulation operand when the input is sharded on its last dim (the operand's last
    dim is always D)."""
    _, _, Shard = _placements()
    return Shard(spec.ndim - 1), Shard(spec.ndim - 1)


# ---------------------------------------------------------------------------------------
# RMSNorm: input [..., D] rows, weight [D] or None.


def _rms_norm_strategies(x, weight, rows_in: int, outputs: int, weight_grad: bool, out_first: int = 0,
                         extra_rows: int = 0, trailing: int = 0):
    """Strategies for the RMSNorm family. Layout of the placement list: ``outputs`` outputs
    (``weight_grad``: the last one is the weight's grad), then ``out_first`` out= tensors,
    then ``rows_in`` row inputs, the weight, ``trailing`` non-tensor arguments and
    ``extra_rows`` optional row tensors (grad_extra) after them."""
    Partial, Replicate, Shard = _placements()
    strategies = []
    for dim in [None, *range(x.ndim - 1)]:
        row = Replicate() if dim is None else Shard(dim)
        out = [row] * (outputs - weight_grad)
        if weight_grad:
            out.append(Replicate() if dim is None or weight is None else Partial())
        inputs = [row] * (out_first + rows_in) + [_rep(weight)] + [None] * trailing
        strategies.append((out, inputs + [row] * extra_rows))
    return strategies


def _rms_norm(x, weight, eps, weight_offset, cast_before_weight, out_dtype):
    return _rms_norm_strategies(x, weight, rows_in=1, outputs=1, weight_grad=False, trailing=4)


def _rms_norm_out(out, x, weight, eps, weight_offset, cast_before_weight):
    return _rms_norm_strategies(x, weight, rows_in=1, outputs=0, weight_grad=False, out_first=1, trailing=3)


def _fused_add_rms_norm(x, residual, weight, eps, weight_offset, cast_before_weight):
    return _rms_norm_strategies(x, weight, rows_in=2, outputs=2, weight_grad=False, trailing=3)


def _fused_add_rms_norm_out(out, residual_out, x, residual, weight, eps, weight_offset, cast_before_weight):
    return _rms_norm_strategies(x, weight, rows_in=2, outputs=0, weight_grad=False, out_first=2, trailing=3)


def _rms_norm_backward(grad_out, x, weight, eps, weight_offset, cast_before_weight, grad_extra):
    strategies = _rms_norm_strategies(x, weight, rows_in=2, outputs=2, weight_grad=True, trailing=3,
                                      extra_rows=1)
    if grad_extra is None:
        strategies = [(out, inputs[:-1] + [None]) for out, inputs in strategies]
    return strategies


# ---------------------------------------------------------------------------------------
# AdaLN and the gated residual: input [B, S, D] or [B, D]; scale, shift and gate [D],
# [B', D] or [B', S', D].


def _modulated_strategies(x, modulations: Sequence, layout: Sequence[str], *,
                          last_dim: bool = False) -> List[list]:
    """Placement lists for an op over rows of ``x``'s shape modulated by broadcasting
    operands, one per split (none, each leading dim, and the last dim if ``last_dim``).
    ``layout`` names each position of the list: "row" (an output or input of the rows'
    shape), "stats" (fp32 ``[..., 2]`` row statistics), "mod<i>" (modulation operand i),
    "grad<i>" (its grad), "-" (not a tensor). Optional tensors are entered as present;
    `_split` blanks the absent ones."""
    _, Replicate, Shard = _placements()
    strategies = []
    for dim in [None, *range(x.ndim - 1)] + ([x.ndim - 1] if last_dim else []):
        if dim is None:
            mods = [(Replicate(), Replicate()) for _ in modulations]
            row = stats = Replicate()
        elif dim == x.ndim - 1:
            if "stats" in layout:
                continue  # row statistics cannot follow a split of the normalised dim
            mods = [_last_dim_following(m) for m in modulations]
            row = stats = Shard(dim)
        else:
            mods = [_following(m, dim) for m in modulations]
            row = stats = Shard(dim)
        placements = []
        for entry in layout:
            if entry == "row":
                placements.append(row)
            elif entry == "stats":
                placements.append(stats)
            elif entry.startswith("mod"):
                placements.append(mods[int(entry[3:])][0])
            elif entry.startswith("grad"):
                placements.append(mods[int(entry[4:])][1])
            else:
                placements.append(None)
        strategies.append(placements)
    return strategies


def _split(strategies: List[list], outputs: int, absent: Sequence[int] = ()) -> List[Strategy]:
    """(outputs, inputs) pairs; the input positions in ``absent`` (optional tensors not
    given) are set to None."""
    result = []
    for placements in strategies:
        inputs = list(placements[outputs:])
        for index in absent:
            inputs[index] = None
        result.append((list(placements[:outputs]), inputs))
    return result


def _adaln(x, scale, shift, eps, norm):
    return _split(_modulated_strategies(x, [scale, shift], ["row", "row", "mod0", "mod1", "-", "-"]), 1)


def _adaln_out(out, x, scale, shift, eps, norm):
    return _split(_modulated_strategies(x, [scale, shift], ["row", "row", "mod0", "mod1", "-", "-"]), 0)


def _adaln_with_stats(x, scale, shift, eps, norm):
    layout = ["row", "stats", "row", "mod0", "mod1", "-", "-"]
    return _split(_modulated_strategies(x, [scale, shift], layout), 2)


def _adaln_backward(grad_out, x, scale, shift, eps, norm, grad_extra, stats=None):
    layout = ["row", "grad0", "grad1", "row", "row", "mod0", "mod1", "-", "-", "row", "stats"]
    absent = [i for i, t in ((6, grad_extra), (7, stats)) if t is None]
    return _split(_modulated_strategies(x, [scale, shift], layout), 3, absent)


def _gated_residual(residual, x, gate):
    return _split(_modulated_strategies(x, [gate], ["row", "row", "row", "mod0"], last_dim=True), 1)


def _gated_residual_out(residual_out, residual, x, gate):
    return _split(_modulated_strategies(x, [gate], ["row", "row", "row", "mod0"], last_dim=True), 0)


def _gated_residual_backward(grad_out, x, gate):
    layout = ["row", "grad0", "row", "row", "mod0"]
    return _split(_modulated_strategies(x, [gate], layout, last_dim=True), 2)


_GATED_RESIDUAL_ADALN_INPUTS = ["row", "row", "mod0", "mod1", "mod2", "-", "-"]


def _gated_residual_adaln(residual, x, gate, scale, shift, eps, norm):
    return _split(_modulated_strategies(x, [gate, scale, shift], ["row", "row", *_GATED_RESIDUAL_ADALN_INPUTS]), 2)


def _gated_residual_adaln_out(residual_out, out, residual, x, gate, scale, shift, eps, norm):
    return _split(_modulated_strategies(x, [gate, scale, shift], ["row", "row", *_GATED_RESIDUAL_ADALN_INPUTS]), 0)


def _gated_residual_adaln_with_stats(residual, x, gate, scale, shift, eps, norm):
    layout = ["row", "row", "stats", *_GATED_RESIDUAL_ADALN_INPUTS]
    return _split(_modulated_strategies(x, [gate, scale, shift], layout), 3)


def _gated_residual_adaln_backward(grad_out, grad_residual_out, residual_out, x, gate, scale, shift, eps, norm,
                                   stats=None):
    layout = ["row", "row", "grad0", "grad1", "grad2",  # grads of residual, input, gate, scale, shift
              "row", "row", "row", "row", "mod0", "mod1", "mod2", "-", "-", "stats"]
    absent = [9] if stats is None else []
    return _split(_modulated_strategies(x, [gate, scale, shift], layout), 5, absent)


# ---------------------------------------------------------------------------------------
# Activations: pointwise (gelu, gelu_mul: any dim) or over pairs of halves of the last dim
# (geglu: leading dims).


def _pointwise(x, outputs: int, tensors: int, trailing: int, last_dim: bool = True) -> List[Strategy]:
    _, Replicate, Shard = _placements()
    dims = [None, *range(x.ndim - (0 if last_dim else 1))]
    strategies = []
    for dim in dims:
        p = Replicate() if dim is None else Shard(dim)
        strategies.append(([p] * outputs, [p] * tensors + [None] * trailing))
    return strategies


def _gelu(x, approximate):
    return _pointwise(x, 1, 1, 1)


def _gelu_out(out, x, approximate):
    return _pointwise(x, 0, 2, 1)


def _gelu_backward(grad, x, approximate):
    return _pointwise(x, 1, 2, 1)


def _gelu_mul(gate, up, approximate):
    return _pointwise(gate, 1, 2, 1)


def _gelu_mul_out(out, gate, up, approximate):
    return _pointwise(gate, 0, 3, 1)


def _gelu_mul_backward(grad, gate, up, approximate):
    return _pointwise(gate, 2, 3, 1)


def _geglu(x, approximate):
    return _pointwise(x, 1, 1, 1, last_dim=False)


def _geglu_out(out, x, approximate):
    return _pointwise(x, 0, 2, 1, last_dim=False)


def _geglu_backward(grad, x, approximate):
    return _pointwise(x, 1, 2, 1, last_dim=False)


# ---------------------------------------------------------------------------------------
# RoPE: q and k [B, S, C], [B, H, S, D] (sequence_dim 2) or [B, S, H, D] (sequence_dim 1);
# cos and sin [S, R] or [B', S, R]. Batch, sequence and head splits; channels stay whole.


def _rope_splits(q, cos, sequence_dim: Optional[int]):
    """(q/k placement, table placement) for each split the RoPE ops take."""
    _, Replicate, Shard = _placements()
    splits = [(Replicate(), Replicate())]
    if q.ndim == 3:
        sequence, heads = 1, None
    else:
        sequence, heads = sequence_dim, 3 - sequence_dim
    batch_table = Shard(0) if cos.ndim == 3 and cos.shape[0] != 1 else Replicate()
    splits.append((Shard(0), batch_table))
    splits.append((Shard(sequence), Shard(cos.ndim - 2)))
    if heads is not None:
        splits.append((Shard(heads), Replicate()))
    return splits


def _rope_strategies(q, cos, sequence_dim, outputs: int, pairs: int, weights: int = 0, trailing: int = 2):
    """``outputs`` outputs like q/k; then ``pairs`` (q, k)-like pairs, ``weights``
    replicated tensors, cos, sin and ``trailing`` non-tensor arguments."""
    _, Replicate, _ = _placements()
    return [([qk] * outputs, [qk] * (2 * pairs) + [Replicate()] * weights + [table, table] + [None] * trailing)
            for qk, table in _rope_splits(q, cos, sequence_dim)]


def _rope(q, k, cos, sin, interleaved, sequence_dim):
    return _rope_strategies(q, cos, sequence_dim, 2, 1)


def _rope_out(q_out, k_out, q, k, cos, sin, interleaved, sequence_dim):
    return _rope_strategies(q, cos, sequence_dim, 0, 2)


def _rope_inplace(q, k, cos, sin, interleaved, sequence_dim):
    return _rope_strategies(q, cos, sequence_dim, 0, 1)


def _rope_backward(grad_q, grad_k, cos, sin, interleaved, sequence_dim):
    return _rope_strategies(grad_q, cos, sequence_dim, 2, 1)


def _qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
    return _rope_strategies(q, cos, None, 2, 1, weights=2, trailing=1)


def _qk_norm_rope_out(q_out, k_out, q, k, q_weight, k_weight, cos, sin, eps):
    return _rope_strategies(q, cos, None, 0, 2, weights=2, trailing=1)


# ---------------------------------------------------------------------------------------
# FP8 producers: input [..., D] rows, per-row scales [..., 1] sharded with them; the weight
# and a static scale replicated.


def _fp8_strategies(x, weight_args: Sequence = (), trailing: int = 0, dynamic: bool = True,
                    static_scale: bool = False, row_inputs: int = 1) -> List[Strategy]:
    """q (and, dynamic, the scales) like the rows; then ``row_inputs`` inputs of the rows'
    shape, ``weight_args`` (tensor or None), ``trailing`` non-tensor arguments and the
    static scale."""
    _, Replicate, Shard = _placements()
    strategies = []
    for dim in [None, *range(x.ndim - 1)]:
        row = Replicate() if dim is None else Shard(dim)
        inputs = [*([row] * row_inputs), *(_rep(w) for w in weight_args), *([None] * trailing)]
        if static_scale:
            inputs.append(Replicate())
        strategies.append(([row, row] if dynamic else [row], inputs))
    return strategies


def _quantize_fp8(x):
    return _fp8_strategies(x)


def _quantize_fp8_static(x, scale):
    return _fp8_strategies(x, dynamic=False, static_scale=True)


def _rms_norm_fp8(x, weight, eps, weight_offset, cast_before_weight):
    return _fp8_strategies(x, [weight], trailing=3)


def _rms_norm_fp8_static(x, weight, eps, weight_offset, cast_before_weight, scale):
    return _fp8_strategies(x, [weight], trailing=3, dynamic=False, static_scale=True)


def _with_static_scale(strategies: List[Strategy]) -> List[Strategy]:
    """The strategies with a replicated static scale as the last input."""
    _, Replicate, _ = _placements()
    return [(outputs, [*inputs, Replicate()]) for outputs, inputs in strategies]


def _adaln_fp8(x, scale, shift, eps, norm):
    layout = ["row", "stats", "row", "mod0", "mod1", "-", "-"]  # q, the scales like row statistics
    return _split(_modulated_strategies(x, [scale, shift], layout), 2)


def _adaln_fp8_static(x, scale, shift, eps, norm, fp8_scale):
    return _with_static_scale(_adaln(x, scale, shift, eps, norm))


def _gated_residual_adaln_fp8(residual, x, gate, scale, shift, eps, norm):
    layout = ["row", "row", "stats", *_GATED_RESIDUAL_ADALN_INPUTS]  # h, q, the scales
    return _split(_modulated_strategies(x, [gate, scale, shift], layout), 3)


def _gated_residual_adaln_fp8_static(residual, x, gate, scale, shift, eps, norm, fp8_scale):
    return _with_static_scale(_gated_residual_adaln(residual, x, gate, scale, shift, eps, norm))


# The GELU family's rows (geglu's [..., 2H] input: leading dims only, as q's rows).
def _gelu_fp8(x, approximate):
    return _fp8_strategies(x, trailing=1)


def _gelu_fp8_static(x, approximate, scale):
    return _fp8_strategies(x, trailing=1, dynamic=False, static_scale=True)


def _gelu_mul_fp8(gate, up, approximate):
    return _fp8_strategies(gate, trailing=1, row_inputs=2)


def _gelu_mul_fp8_static(gate, up, approximate, scale):
    return _fp8_strategies(gate, trailing=1, dynamic=False, static_scale=True, row_inputs=2)


# op name -> the function listing its strategies (register_sharding's contract: called with
# the op's arguments, each tensor replaced by its DTensor spec).
RULES: Dict[str, Callable] = {
    "rms_norm": _rms_norm,
    "rms_norm_out": _rms_norm_out,
    "fused_add_rms_norm": _fused_add_rms_norm,
    "fused_add_rms_norm_out": _fused_add_rms_norm_out,
    "rms_norm_backward": _rms_norm_backward,
    "adaln": _adaln,
    "adaln_out": _adaln_out,
    "adaln_with_stats": _adaln_with_stats,
    "adaln_backward": _adaln_backward,
    "gated_residual": _gated_residual,
    "gated_residual_out": _gated_residual_out,
    "gated_residual_backward": _gated_residual_backward,
    "gated_residual_adaln": _gated_residual_adaln,
    "gated_residual_adaln_out": _gated_residual_adaln_out,
    "gated_residual_adaln_with_stats": _gated_residual_adaln_with_stats,
    "gated_residual_adaln_backward": _gated_residual_adaln_backward,
    "gelu": _gelu,
    "gelu_out": _gelu_out,
    "gelu_backward": _gelu_backward,
    "gelu_mul": _gelu_mul,
    "gelu_mul_out": _gelu_mul_out,
    "gelu_mul_backward": _gelu_mul_backward,
    "geglu": _geglu,
    "geglu_out": _geglu_out,
    "geglu_backward": _geglu_backward,
    "rope": _rope,
    "rope_out": _rope_out,
    "rope_": _rope_inplace,
    "rope_backward": _rope_backward,
    "qk_norm_rope": _qk_norm_rope,
    "qk_norm_rope_out": _qk_norm_rope_out,
    "quantize_fp8": _quantize_fp8,
    "quantize_fp8_static": _quantize_fp8_static,
    "rms_norm_fp8": _rms_norm_fp8,
    "rms_norm_fp8_static": _rms_norm_fp8_static,
    "adaln_fp8": _adaln_fp8,
    "adaln_fp8_static": _adaln_fp8_static,
    "gated_residual_adaln_fp8": _gated_residual_adaln_fp8,
    "gated_residual_adaln_fp8_static": _gated_residual_adaln_fp8_static,
    "gelu_fp8": _gelu_fp8,
    "gelu_fp8_static": _gelu_fp8_static,
    "gelu_mul_fp8": _gelu_mul_fp8,
    "gelu_mul_fp8_static": _gelu_mul_fp8_static,
    "geglu_fp8": _gelu_fp8,
    "geglu_fp8_static": _gelu_fp8_static,
}

_registered = False
_lock = threading.Lock()


def register() -> bool:
    """Register the rules with DTensor (idempotent). False when this torch has no
    ``torch.distributed.tensor``."""
    global _registered
    with _lock:
        if _registered:
            return True
        if not torch.distributed.is_available():
            return False
        from torch.distributed.tensor.experimental import register_sharding

        for name, rule in RULES.items():
            if hasattr(ops, name):
                register_sharding(getattr(ops, name).default)(rule)
        _registered = True
        return True


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers the rules right after ``torch.distributed.tensor`` is imported: finds its
    spec with the other finders and wraps the loader's ``exec_module``."""

    def find_spec(self, name, path=None, target=None):
        if name != _DTENSOR_MODULE:
            return None
        _remove_hook()
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                register()
            except Exception:  # never break the import of torch.distributed.tensor itself
                logging.getLogger(__name__).warning("ltx-kernels: DTensor sharding rules not registered",
                                                    exc_info=True)

        loader.exec_module = exec_then_register
        return spec


_hook: Optional[_RegisterAfterImport] = None


def _remove_hook() -> None:
    global _hook
    if _hook is not None and _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
    _hook = None


def register_when_available() -> None:
    """At package import: register now if ``torch.distributed.tensor`` is imported, else
    as soon as it is."""
    global _hook
    if _DTENSOR_MODULE in sys.modules:
        register()
    elif _hook is None and torch.distributed.is_available():
        _hook = _RegisterAfterImport()
        sys.meta_path.insert(0, _hook)
