"""Forward results are bitwise deterministic: the same input gives the same bits run to
run, and under conditions that must not matter: the CPU thread count, the batch a row
is computed in (on CUDA, batches of one launch regime: docs/numerics.md), where the input
lives in memory, and (CUDA) the stream."""

import pytest
import torch

from test_bad_inputs import APIS, Dims
from test_numerics import BOUNDS

OPS = [api for api in APIS if api.name in BOUNDS]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INT_OF_SIZE = {2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN payloads and the sign of zero included)."""
    return t.contiguous().view(INT_OF_SIZE[t.element_size()]).cpu()


def same_bits(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def dims_for(api):
    # 64 rows of 1000: enough rows to split over CPU threads. RoPE: 8 heads of 128 and
    # 512 tokens, so on CUDA the whole batch takes the path of four heads per thread
    # (>= 2 tokens per SM) and one batch entry alone (128 tokens) the one-head path.
    if "rope" in api.name:
        return Dims(b=4, s=128, d=128, heads=8, rotary=96)
    return Dims(b=4, s=16, d=1000, heads=8, rotary=96)


def fresh(api, kernel, tensors):
    """Runs on copies, so that in-place ops see the same input every time."""
    return [o.clone() for o in api.call(kernel, {k: v.clone() for k, v in tensors.items()})]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("api", OPS, ids=lambda a: a.name)
def test_same_input_same_bits(kernel, device, api, dtype):
    tensors = api.make(dims_for(api), dtype, device)
    first = fresh(api, kernel, tensors)
    assert same_bits(first, fresh(api, kernel, tensors))


@pytest.mark.parametrize("api", OPS, ids=lambda a: a.name)
def test_a_row_does_not_depend_on_its_batch_or_address(kernel, device, api):
    """Batch entry 1 computed alone (its own launch, another address with the same
    alignment) gives the bits it has inside the whole batch."""
    tensors = api.make(dims_for(api), torch.bfloat16, device)
    whole = fresh(api, kernel, tensors)
    per_batch = {a.key for a in api.args if a.kind != "weight"}  # weights are [D]
    alone = {k: (v[1:2] if k in per_batch else v) for k, v in tensors.items()}
    assert all(v.data_ptr() % 16 == 0 for v in alone.values())
    assert same_bits([o[1:2] for o in whole], fresh(api, kernel, alone))


@pytest.mark.parametrize("api", OPS, ids=lambda a: a.name)
def test_cpu_thread_count_does_not_change_bits(kernel, device, api):
    if device != "cpu":
        pytest.skip("CPU twins only")
    tensors = api.make(dims_for(api), torch.float16, device)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = fresh(api, kernel, tensors)
        torch.set_num_threads(max(2, threads))
        assert same_bits(single, fresh(api, kernel, tensors))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("api", OPS, ids=lambda a: a.name)
def test_cuda_stream_does_not_change_bits(kernel, device, api):
    if device != "cuda":
        pytest.skip("needs a GPU")
    tensors = api.make(dims_for(api), torch.bfloat16, device)
    on_default = fresh(api, kernel, tensors)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs are ready
    busy = torch.randn(4096, 4096, device="cuda")
    busy = busy @ busy  # the default stream stays busy while the side stream runs the op
    with torch.cuda.stream(side):
        on_side = fresh(api, kernel, tensors)
    torch.cuda.synchronize()
    assert same_bits(on_default, on_side)
