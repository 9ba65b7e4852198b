"""The fake (meta) implementations check what the compiled ops check, with the same
messages: a bad call fails under FakeTensorMode, on meta tensors and at torch.compile's
trace time as it fails eagerly, and a good call still traces, with dynamic shapes too.

Generated from the bad-input table (tests/test_bad_inputs.py) and from every registered
op's valid call (tests/test_compile.py) varied one argument at a time: each call runs
for real, then on fake tensors (static and symbolic sizes) and on meta tensors; the
outcomes must agree (the same error type and message, device names aside, or outputs of
the same sizes, strides and dtypes). Plus: a meta tensor beside real ones is refused
for every tensor argument of every op, the fakes apply CUDA's rules to CUDA tensors
(the table's expectations on fake CUDA tensors, without a GPU), and nested tensors get
a message naming the function and what to do."""

import contextlib
import functools
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.meta_utils import MetaConverter
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import test_bad_inputs as table
from conftest import HAS_GPU, load_variant
from test_compile import _cases as op_cases, _model, _model_inputs

DEVICE_NAME = re.compile(r"\b(?:cpu|cuda:\d+|meta)\b")
# Autograd's names for a tensor's type, which name its device too: torch.FloatTensor, MetaFloatType.
TENSOR_TYPE = re.compile(r"\b(?:torch\.(?:cuda\.)?\w+Tensor|Meta\w+Type)\b")
# The dispatcher's own message for a backend without a kernel: compared up to its first sentence.
NO_KERNEL = re.compile(r"Could not run '[^']+' with arguments from the '\w+' backend")
# Integer arithmetic as SymInts print it: 2*64, 6**2, (128//2).
ARITHMETIC = re.compile(r"\(\d+\)|\d+(?:\s*(?:\*\*|//|[*+])\s*\d+)+")


def attempt(call):
    """The call's outputs (a tuple), or the exception it raised."""
    try:
        outputs = call()
    except Exception as e:  # every kind: the outcomes are compared, not expected
        return e
    return outputs if isinstance(outputs, tuple) else (outputs,)


def summary(outcome, devices: bool = True):
    """What must agree between a real call and its fake: the error type and message, or
    each output's sizes, strides and dtype (and device, unless `devices` is off)."""
    if isinstance(outcome, Exception):
        message = str(outcome)
        no_kernel = NO_KERNEL.match(message)
        message = no_kernel.group(0) if no_kernel else message
        if not devices:
            message = TENSOR_TYPE.sub("<tensor type>", DEVICE_NAME.sub("<device>", message))
        return type(outcome).__name__, message
    return [None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, t.device if devices else None)
            for t in outcome]


def symbolic_summary(outcome, shape_env: ShapeEnv):
    """summary() of a call on symbolic sizes, with each size's value in place of its symbol."""
    values = shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else shape_env.var_to_val

    def value(size):
        return int(size.node.expr.xreplace(values)) if isinstance(size, torch.SymInt) else size

    if not isinstance(outcome, Exception):
        return [None if t is None else (tuple(map(value, t.shape)), tuple(map(value, t.stride())), t.dtype, None)
                for t in outcome]
    names = {str(symbol): str(v) for symbol, v in values.items()}
    kind, message = summary(outcome, devices=False)
    message = re.sub(r"\bs\d+\b", lambda m: names.get(m.group(0), m.group(0)), message)
    # Sizes computed from symbols print as expressions: 64*2 is the 128 of the real message.
    while True:
        evaluated = ARITHMETIC.sub(lambda m: str(eval(m.group(0))), message)
        if evaluated == message:
            return kind, message
        message = evaluated


def as_fakes(tensors: dict, mode: FakeTensorMode) -> dict:
    # One converter: views of one storage stay views of one fake storage.
    return {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}


def as_metas(tensors: dict) -> dict:
    convert = MetaConverter()
    return {k: convert(v) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}


def compare_fakes(call, tensors: dict, real, meta: bool = True):
    """call(tensors) on fake tensors (static sizes, then symbolic ones) and, for CPU
    tensors and unless `meta` is off, on meta tensors: each outcome as the real call's."""
    mode = FakeTensorMode()
    fakes = as_fakes(tensors, mode)
    with mode:
        assert summary(attempt(lambda: call(fakes))) == summary(real), "FakeTensorMode"
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    fakes = as_fakes(tensors, mode)
    with mode:
        got = symbolic_summary(attempt(lambda: call(fakes)), shape_env)
    assert got == summary(real, devices=False), "symbolic sizes"
    if meta and all(t.device.type == "cpu" for t in tensors.values() if isinstance(t, torch.Tensor)):
        assert summary(attempt(lambda: call(as_metas(tensors))), devices=False) == summary(real, devices=False), \
            "meta tensors"


# ---------------------------------------------------------------------------- the bad-input table


def runs_backward(case) -> bool:
    return case.label.endswith(("_saved_for_backward", "double_backward"))


def runs_autograd(case) -> bool:
    """Cases whose tensors carry autograd state that fakes converted from real tensors do
    not: dual tensors, and tensors with a history that a backward runs through."""
    return case.context is not contextlib.nullcontext or runs_backward(case)


def run_case(kernel, case, device: str, backend: str):
    """The case's outcome, its tensors made, perturbed and called on `device` (under the
    case's context)."""
    with case.context():
        tensors = case.api.make(case.dims, case.dtype, device)
        case.perturb(tensors, table.Target(backend, device))
        return attempt(lambda: case.api.call(kernel, tensors))


@pytest.mark.parametrize("case", table.CASES, ids=str)
def test_table_case_fails_on_fakes_as_it_fails_for_real(target, case):
    kernel, device = target
    if case.gpu_only and not HAS_GPU:
        pytest.skip("needs a second device (GPU)")
    backend = "cuda" if "_cuda_" in kernel.ops.name else "cpu"
    if runs_autograd(case):
        # The autograd kernels refuse these before any fake runs: the case as a whole on
        # fake tensors and on meta tensors (sizes, not values, decide the outcome).
        real = run_case(kernel, case, device, backend)
        with FakeTensorMode():
            assert summary(run_case(kernel, case, device, backend)) == summary(real), "FakeTensorMode"
        assert summary(run_case(kernel, case, "meta", backend), devices=False) == summary(real, devices=False), \
            "meta tensors"
        return
    tensors = case.api.make(case.dims, case.dtype, device)
    case.perturb(tensors, table.Target(backend, device))
    real = attempt(lambda: case.api.call(kernel, tensors))  # it may write into them; sizes stay
    # The layers hand meta tensors to the host (as any device they have no kernel for).
    compare_fakes(lambda t: case.api.call(kernel, t), tensors, real, meta=not case.api.name.startswith("layers."))


# (A backward on fake CUDA tensors needs a CUDA device: the cases that run one are compared
# on fake CPU tensors above.)
@pytest.mark.parametrize("case", [c for c in table.CASES if not c.api.name.startswith("layers.")
                                  and not runs_backward(c)], ids=str)
def test_table_case_on_fake_cuda_tensors(case):
    """The CUDA variant's rules (no float64, qk_norm_rope's row limit, a CPU tensor beside
    CUDA ones) hold on fake CUDA tensors: without a GPU, the table's expectation for CUDA."""
    kernel = table_kernel("cuda")
    with FakeTensorMode(), case.context():
        tensors = case.api.make(case.dims, case.dtype, "cuda")
        expect = case.perturb(tensors, table.Target("cuda", "cuda"))
        outcome = attempt(lambda: case.api.call(kernel, tensors))
    if isinstance(expect, table.Refuse):
        assert isinstance(outcome, expect.error), f"expected a refusal naming {expect.names}, got {outcome!r}"
        names = "|".join(re.escape(n) for n in expect.names)
        assert re.search(rf"(?<![\w.])({names})(?!\w)", str(outcome)), outcome
    else:
        assert not isinstance(outcome, Exception), outcome


@functools.cache
def table_kernel(backend: str):
    if torch.version.cuda is None and backend == "cuda":
        pytest.skip("torch is not a CUDA build: no CUDA variant")
    return load_variant(backend)


# ---------------------------------------------------------------------------- every registered op


def op_and_args(kernel, device, case: str):
    op = getattr(kernel.ops, case.split(":")[0]).default
    return op, op._schema, list(op_cases(device)[case])


def tensor_variants(t: torch.Tensor):
    """(label, tensor) variations of one tensor argument."""
    for dtype in (torch.float32, torch.float16, torch.float64, torch.int32):
        if dtype != t.dtype:
            yield f"as_{dtype}", t.to(dtype)
    yield "last_dim_plus_1", torch.cat([t, t[..., :1]], -1)
    yield "leading_dim_added", t[None]
    if t.dim() >= 2:
        yield "leading_dim_dropped", t[0]
        yield "first_dim_plus_1", torch.cat([t, t[:1]], 0)
        yield "leading_dims_transposed", table.transposed_leading(t)
    yield "last_dim_strided", table.strided_last_dim(t)
    yield "misaligned", table.misaligned(t)
    if t.shape[0] > 1:
        yield "expanded", t[:1].expand(t.shape)


def scalar_variants(argument):
    kind = str(argument.type)
    if argument.name == "eps":
        yield from (("negative", -1e-6), ("nan", float("nan")))
    elif kind == "str":
        yield "unknown", "group"
    elif argument.name == "sequence_dim":
        yield from (("0", 0), ("3", 3))
    elif kind == "Optional[ScalarType]":
        yield from (("float16", torch.float16), ("int32", torch.int32), ("float64", torch.float64))


def op_variants(schema, args):
    """(label, args) with one argument changed, or a written argument sharing memory with
    another tensor argument."""
    names = [a.name for a in schema.arguments]
    slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for i, a in enumerate(args):
        changes = tensor_variants(a) if i in slots else scalar_variants(schema.arguments[i])
        for label, value in changes:
            yield f"{names[i]}_{label}", args[:i] + [value] + args[i + 1:]
    written = [i for i in slots if schema.arguments[i].alias_info is not None and schema.arguments[i].alias_info.is_write]
    for i in written:
        for j in slots:
            if i != j and args[i].dtype == args[j].dtype:
                if args[i].shape == args[j].shape and i < j:
                    yield f"{names[i]}_is_{names[j]}", [args[j] if n == i else a for n, a in enumerate(args)]
                if args[i].numel() <= args[j].numel():
                    shared_i, shared_j = table.sharing(args[i], args[j])
                    yield f"{names[i]}_partly_overlaps_{names[j]}", \
                        [shared_i if n == i else shared_j if n == j else a for n, a in enumerate(args)]


@pytest.mark.parametrize("case", list(op_cases("cpu")))
def test_every_op_fails_on_fakes_as_it_fails_for_real(kernel, device, case):
    op, schema, args = op_and_args(kernel, device, case)
    refused = 0
    for label, changed in op_variants(schema, args):
        named = dict(enumerate(changed))
        real = attempt(lambda: op(*changed))
        refused += isinstance(real, Exception)
        try:
            compare_fakes(lambda t: op(*(t[n] for n in range(len(t)))), named, real)
        except AssertionError as e:
            raise AssertionError(f"{label}: real {summary(real)}; {e}") from None
    assert refused >= 4, f"only {refused} variations refused: the variations no longer test the checks"


@pytest.mark.parametrize("case", list(op_cases("cpu")))
def test_meta_tensor_beside_real_tensors_is_refused(kernel, device, case):
    """A meta tensor mixed into a CPU (or CUDA) call reaches the fake, which refused nothing
    and returned an uninitialised tensor; now it names the argument on the other device."""
    op, schema, args = op_and_args(kernel, device, case)
    names = [a.name for a in schema.arguments]
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if len(tensors) < 2:
        pytest.skip("one tensor: nothing beside it")
    for i in tensors:
        t = args[i]
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        for mixed, where in (([meta if n == i else a for n, a in enumerate(args)], "meta"),
                              ([t if n == i else as_metas({0: a})[0] for n, a in enumerate(args)], str(t.device))):
            with pytest.raises(RuntimeError) as info:
                op(*mixed)
            assert re.search(rf"\b{names[i]} is on {re.escape(where)}\b", str(info.value)), info.value
            assert re.search(r"\bis on (meta|cpu|cuda:\d+) but \w+ is on (meta|cpu|cuda:\d+)$", str(info.value)), \
                info.value


# ---------------------------------------------------------------------------- torch.compile


def first_refusals(per_api: int = 2):
    """A few cases per function of the table that the compiled op refuses (not Python
    before it, not a layer, which leaves torch.compile to the host)."""
    taken = {}
    for case in table.CASES:
        api = case.api
        if case.gpu_only or api.name.startswith("layers.") or taken.get(api.name, 0) >= per_api:
            continue
        expect = case.perturb(api.make(case.dims, case.dtype, "cpu"), table.Target("cpu", "cpu"))
        if isinstance(expect, table.Refuse) and expect.error is RuntimeError and "0dim" not in case.label:
            taken[api.name] = taken.get(api.name, 0) + 1
            yield case


@pytest.mark.parametrize("case", list(first_refusals()), ids=str)
def test_compile_refuses_a_bad_call_at_trace_time(kernel, device, case):
    import torch._dynamo

    tensors = case.api.make(case.dims, case.dtype, device)
    case.perturb(tensors, table.Target("cuda" if "_cuda_" in kernel.ops.name else "cpu", device))
    with pytest.raises(RuntimeError) as eager:
        case.api.call(kernel, tensors)  # refused before anything is written
    keys = list(tensors)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda *ts: case.api.call(kernel, dict(zip(keys, ts))), backend=backend, fullgraph=True)
    with pytest.raises(Exception) as traced:
        compiled(*tensors.values())
    assert str(eager.value) in str(traced.value)
    assert not graphs, "the bad call traced; it failed only when the compiled code ran"


@pytest.mark.parametrize("mark", ["dynamic=True", "mark_dynamic"])
def test_compile_with_dynamic_shapes_matches_eager_without_recompiles(kernel, device, mark):
    """Symbolic sizes through every op's fake and autograd formula, forward and backward:
    new batch and sequence lengths reuse the one graph. (aot_eager: traced as inductor
    traces, without the size guards of inductor's own CPU code generation.)"""
    import torch._dynamo

    torch._dynamo.reset()
    block = _model(kernel)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True,
                             dynamic=True if mark == "dynamic=True" else None)
    tables = {8, 9, 10, 11}  # cos, sin, lcos, lsin: constants
    # Sizes unlike every other one (heads 2 and 4, channels 32 and 64): no two dims share a symbol.
    for n, (batch, seq) in enumerate([(3, 5), (6, 7), (7, 9)]):
        inputs = []
        for i, t in enumerate(_model_inputs(device)):
            batch_dim = t.dim() >= 2 and t.shape[0] == 2
            seq_dims = [d for d, size in enumerate(t.shape) if size == 5]
            shape = [batch if d == 0 and batch_dim else seq if d in seq_dims else size for d, size in enumerate(t.shape)]
            inputs.append(torch.randn(shape, device=device, requires_grad=i not in tables))
            if mark == "mark_dynamic":
                for d in [0] * batch_dim + seq_dims:
                    torch._dynamo.mark_dynamic(inputs[-1], d)
        leaves = [t for i, t in enumerate(inputs) if i not in tables]
        with torch._dynamo.config.patch(error_on_recompile=n > 0):
            got = compiled(*inputs)
            got_grads = torch.autograd.grad(got, leaves)
        want = block(*inputs)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
        for a, b in zip(got_grads, torch.autograd.grad(want, leaves)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)


# ---------------------------------------------------------------------------- nested tensors


def nested_like(t: torch.Tensor, layout) -> torch.Tensor:
    """Two sequences of t's rows (the second one shorter): a ragged batch."""
    return torch.nested.nested_tensor([t[0], t[1, :1]], layout=layout)


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
@pytest.mark.parametrize("api", [a for a in table.APIS if not a.name.startswith("layers.")], ids=lambda a: a.name)
def test_nested_tensor_gets_a_message_naming_the_function(kernel, device, api, layout):
    function = api.name.split("[")[0]
    for arg in (api.primary, *(a for a in api.args if a.output)):
        tensors = api.make(table.Dims(), torch.float32, device)
        tensors[arg.key] = nested_like(tensors[arg.key], layout)
        with pytest.raises(RuntimeError) as info:
            api.call(kernel, tensors)
        message = str(info.value)
        assert message.startswith(f"{function}: nested tensors"), message
        assert "nt.values()" in message or "nt.to_padded_tensor" in message, message


@pytest.mark.parametrize("api", [a for a in table.APIS if not a.name.startswith("layers.")], ids=lambda a: a.name)
def test_compile_with_data_dependent_sizes_matches_eager(kernel, device, api):
    """Rows picked by a boolean mask have a size known only at run time: the fakes' checks
    leave what it decides to run time instead of failing the trace."""
    import torch._dynamo

    tensors = api.make(table.Dims(b=3), torch.float32, device)
    keys = list(tensors)
    mask = torch.tensor([True, False, True], device=device)

    def picked_rows(mask, *ts):
        return api.call(kernel, {k: t[mask] if t.dim() >= 2 and t.shape[0] == 3 else t for k, t in zip(keys, ts)})

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = torch.compile(picked_rows, backend="aot_eager", fullgraph=True)(mask, *tensors.values())
    for a, b in zip(got, picked_rows(mask, *tensors.values())):
        torch.testing.assert_close(a, b, equal_nan=False)
