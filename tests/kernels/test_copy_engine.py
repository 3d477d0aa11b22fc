"""The copy engine (kernels/gather_copy/copy_engine.py): its worker builds everywhere and, with
no CUDA driver, refuses to start with a one-line reason; on a GPU a posted plan's rows land in
their slots, every other row untouched, eagerly and inside a captured graph, and a wait returns
only once they have."""
import ctypes

import pytest
import torch

from moeferry.kernels import cpp_build
from moeferry.kernels.gather_copy import copy_engine
from tests.kernels.test_gather_copy import BANK_SHAPES, byte_rows, random_bank

try:
    copy_engine.library()
    BUILDS = True
except cpp_build.BuildUnavailable:
    BUILDS = False


@pytest.mark.skipif(not BUILDS, reason="no C++ compiler")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA driver")
def test_without_a_cuda_context_the_worker_refuses_to_start():
    table = copy_engine.MoECopyTable()
    error = ctypes.create_string_buffer(128)
    assert not copy_engine.library().moe_copy_engine_start(ctypes.byref(table), error, len(error))
    assert error.value and b"\n" not in error.value
    assert not copy_engine.available("cpu")


def _plan(capacity, count, num_experts, num_slots, generator):
    plan = torch.zeros(1 + 2 * capacity, dtype=torch.int32)
    plan[0] = count
    plan[1:1 + capacity] = torch.randperm(num_experts, generator=generator)[:capacity].int()
    plan[1 + capacity:] = torch.randperm(num_slots, generator=generator)[:capacity].int()
    return plan.cuda()


def _check(host_layers, slots, before, layer, plan):
    plan = plan.cpu()
    count, capacity = int(plan[0]), (plan.numel() - 1) // 2
    planned = {int(d): int(s) for s, d in zip(plan[1:1 + count], plan[1 + capacity:1 + capacity + count])}
    for bank, host, poison in zip(slots, host_layers[layer], before):
        after = byte_rows(bank).cpu()
        for slot in range(after.shape[0]):
            want = byte_rows(host)[planned[slot]] if slot in planned else poison[slot]
            assert torch.equal(after[slot], want), f"{bank.dtype} slot {slot}"


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_posted_rows_land_in_their_slots_and_nothing_else(graph):
    generator = torch.Generator().manual_seed(1)
    num_experts, num_slots, capacity, layers = 10, 14, 8, 3
    host_layers = [[random_bank(num_experts, shape, dtype, generator).pin_memory() for shape, dtype in BANK_SHAPES]
                   for _ in range(layers)]
    slots = [random_bank(num_slots, shape, dtype, generator, "cuda") for shape, dtype in BANK_SHAPES]
    engine = copy_engine.CopyEngine(host_layers, slots, capacity, torch.device("cuda"))
    plan = torch.zeros(1 + 2 * capacity, dtype=torch.int32, device="cuda")
    engine.post(0, plan)  # an empty plan, eagerly: the kernels compiled before any capture
    engine.wait()
    for layer, count in ((1, 5), (2, 0), (0, 8), (1, 3)):
        before = [byte_rows(bank).cpu().clone() for bank in slots]
        plan.copy_(_plan(capacity, count, num_experts, num_slots, generator))
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                engine.post(layer, plan)
                engine.wait()
            g.replay()
        else:
            engine.post(layer, plan)
            engine.wait()
        torch.cuda.synchronize()
        assert engine.failed() is None
        _check(host_layers, slots, before, layer, plan)
    engine.close()


@pytest.mark.gpu
def test_a_bad_layer_is_reported_not_hung():
    generator = torch.Generator().manual_seed(2)
    host = [[random_bank(4, (8,), torch.float32, generator).pin_memory()]]
    slots = [random_bank(6, (8,), torch.float32, generator, "cuda")]
    engine = copy_engine.CopyEngine(host, slots, 4, torch.device("cuda"))
    engine.post(3, _plan(4, 2, 4, 6, generator))
    engine.wait()
    torch.cuda.synchronize()
    assert engine.error_code() == -1 and "CUDA driver error -1" in engine.failed()
    engine.close()


@pytest.mark.gpu
def test_the_engine_reading_a_step_s_tokens_does_not_stall_the_worker():
    """The engine reads each step's tokens while the graph may still wait on the worker. A
    pageable read (`tensor.tolist()`) blocks in the driver in a way that stalls the worker's
    calls until the wait gives up (seen on an H100: the engine hung); the sampler reads through
    pinned memory and an event, which leaves the worker its calls."""
    from types import SimpleNamespace

    from moeferry.engine.sampler import SampleBuffers, Sampler

    generator = torch.Generator().manual_seed(3)
    host = [[random_bank(6, (4096,), torch.float32, generator).pin_memory()]]
    slots = [random_bank(8, (4096,), torch.float32, generator, "cuda")]
    engine = copy_engine.CopyEngine(host, slots, 4, torch.device("cuda"))
    sampler = Sampler(2, 16, torch.device("cuda"))
    buffers = SampleBuffers.allocate(1, 16, torch.device("cuda"))
    plan = _plan(4, 3, 6, 8, generator)
    before = [byte_rows(bank).cpu().clone() for bank in slots]
    engine.post(0, plan)
    engine.wait(max_polls=1 << 22)
    buffers.tokens.fill_(7)  # a step's tokens, queued behind the wait
    assert sampler.read(buffers, [SimpleNamespace(params=SimpleNamespace(logprobs=None))]).tokens == [7]
    assert engine.failed() is None
    _check(host, slots, before, 0, plan)
    engine.close()
