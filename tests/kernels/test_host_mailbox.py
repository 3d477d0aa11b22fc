"""The host kernel's mailbox: the worker thread (host_experts.cpp) runs each posted call and
publishes it done, its outputs those of a direct run; the GPU side's kernels (interpreted on
CPU) post and wait as their reference does, and a wait with no worker gives up and says so."""
import ctypes
import time

import pytest
import torch

from moeferry.kernels import host_mailbox as mailbox
from moeferry.kernels.fused_moe import host as host_kernel
from moeferry.kernels.host_mailbox import reference

needs_kernel = pytest.mark.skipif(not host_kernel.available(), reason="no C++ compiler for the host kernel")


def _implementations():
    from moeferry.kernels.host_mailbox import triton as triton_mailbox
    return {"reference": reference, "triton": triton_mailbox}


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_post_writes_the_call_then_the_next_sequence_number(impl):
    ops = _implementations()[impl]
    box = torch.zeros(mailbox.MAILBOX_WORDS, dtype=torch.int64)
    counter = torch.zeros(mailbox.COUNTER_WORDS, dtype=torch.int64)
    for sequence, call in enumerate([5, 0, 123456], start=1):
        ops.post_request(box, counter, call)
        assert int(counter[0]) == sequence and int(box[mailbox.REQUEST]) == sequence
        assert int(box[mailbox.CALL]) == call and int(box[mailbox.DONE]) == 0


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_wait_returns_once_done_and_gives_up_flagged_otherwise(impl):
    ops = _implementations()[impl]
    box = torch.zeros(mailbox.MAILBOX_WORDS, dtype=torch.int64)
    counter = torch.tensor([3, 0, 2], dtype=torch.int64)
    box[mailbox.DONE] = 3
    ops.wait_done(box, counter, 5)
    assert int(counter[mailbox.STALLED]) == 0 and int(counter[mailbox.CONFIRMED]) == 3
    counter[0] = 4  # no worker: the wait polls 5 times, then flags the stall
    ops.wait_done(box, counter, 5)
    assert int(counter[mailbox.STALLED]) == 1 and int(counter[mailbox.CONFIRMED]) == 3


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_post_stages_its_inputs_and_a_post_of_nothing_stages_nothing(impl):
    ops = _implementations()[impl]
    box = torch.zeros(mailbox.MAILBOX_WORDS, dtype=torch.int64)
    counter = torch.zeros(mailbox.COUNTER_WORDS, dtype=torch.int64)
    plan = torch.arange(1, 2502, dtype=torch.int32)  # past two passes of the kernel's block
    tokens = torch.randn(3, 5, dtype=torch.bfloat16)
    ids = torch.tensor([[4, -1], [-1, 2]], dtype=torch.int64)
    staged = (torch.full_like(plan, -7), torch.zeros_like(tokens), torch.zeros(2, 2, dtype=torch.int32))
    stage = [(plan, staged[0]), (tokens, staged[1]), (ids, staged[2])]
    plan[0] = 0  # no rows: nothing posted, nothing staged
    ops.post_request(box, counter, 3, plan[:1], 1, stage=stage)
    assert int(counter[0]) == 0 and bool((staged[0] == -7).all()) and not staged[1].any()
    plan[0] = 5
    ops.post_request(box, counter, 3, plan[:1], 1, stage=stage)
    assert int(counter[0]) == 1 and int(box[mailbox.REQUEST]) == 1 and int(box[mailbox.CALL]) == 3
    assert torch.equal(staged[0], plan) and torch.equal(staged[1], tokens) and torch.equal(staged[2], ids.int())


def test_a_stage_of_another_size_or_a_converted_float_is_refused():
    box = torch.zeros(mailbox.MAILBOX_WORDS, dtype=torch.int64)
    counter = torch.zeros(mailbox.COUNTER_WORDS, dtype=torch.int64)
    for source, staged in ((torch.zeros(5, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)),
                           (torch.zeros(5), torch.zeros(5, dtype=torch.bfloat16))):
        with pytest.raises(ValueError, match="pair 0"):
            mailbox.post_request(box, counter, 0, stage=[(source, staged)])


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_call_with_no_work_posts_nothing_and_its_wait_reads_no_mailbox(impl):
    ops = _implementations()[impl]
    box = torch.zeros(mailbox.MAILBOX_WORDS, dtype=torch.int64)
    counter = torch.zeros(mailbox.COUNTER_WORDS, dtype=torch.int64)
    none_routed = torch.full((3, 8), -1, dtype=torch.int64)
    ops.post_request(box, counter, 7, none_routed)
    assert int(counter[0]) == 0 and int(box[mailbox.REQUEST]) == 0 and int(box[mailbox.CALL]) == 0
    box[mailbox.DONE] = -1  # a wait that read the mailbox would stall on this
    ops.wait_done(box, counter, 5)
    assert int(counter[mailbox.STALLED]) == 0
    many = torch.full((300, 2), -1, dtype=torch.int64)  # past one pass of the post kernel's ids
    many[299, 1] = 4
    ops.post_request(box, counter, 7, many)
    assert int(counter[0]) == 1 and int(box[mailbox.REQUEST]) == 1 and int(box[mailbox.CALL]) == 7
    box[mailbox.DONE] = 1
    ops.wait_done(box, counter, 5)
    assert int(counter[mailbox.STALLED]) == 0 and int(counter[mailbox.CONFIRMED]) == 1
    plan_count = torch.zeros(1, dtype=torch.int32)  # a copy plan's count: work from 1 on
    ops.post_request(box, counter, 2, plan_count, 1)
    assert int(counter[0]) == 1
    plan_count[0] = 3
    ops.post_request(box, counter, 2, plan_count, 1)
    assert int(counter[0]) == 2 and int(box[mailbox.REQUEST]) == 2 and int(box[mailbox.CALL]) == 2


def _poll(box, word, value, seconds=10.0):
    deadline = time.monotonic() + seconds
    while int(box[word]) < value:
        assert time.monotonic() < deadline, f"mailbox word {word} never reached {value}"
        time.sleep(1e-4)


@needs_kernel
def test_the_worker_runs_each_posted_call_and_publishes_it_done():
    from tests.kernels.test_fused_moe_host import make_case

    calls, outs, direct, held = [], [], [], []
    for seed in range(3):
        hidden, w13, w2, weights, ids = make_case(3, 2, 64, 32, 8, seed)
        held.append((hidden, w13, w2, weights, ids))
        out = torch.empty(*ids.shape, hidden.shape[1], dtype=torch.bfloat16)
        act = torch.empty(ids.numel(), w2.shape[2], dtype=torch.bfloat16)
        held.append(act)
        calls.append(host_kernel.make_call(hidden, ids, weights, out, w13, w2, act, 2))
        outs.append(out)
        direct.append(host_kernel.expert_routes(hidden, w13, w2, weights, ids, threads=2))
    box = torch.zeros(mailbox.MAILBOX_WORDS, dtype=torch.int64)
    table = (ctypes.c_void_p * 4)(*[ctypes.addressof(c) for c in calls], None)
    worker = host_kernel.library().moe_host_worker_start(box.data_ptr(), table, 4)
    try:
        counter = torch.zeros(mailbox.COUNTER_WORDS, dtype=torch.int64)
        for index in (2, 0, 1, 2):
            outs[index].fill_(7)
            reference.post_request(box, counter, index)
            _poll(box, mailbox.DONE, int(counter[0]))
            assert torch.equal(outs[index], direct[index]) and outs[index].abs().max() > 0
        reference.post_request(box, counter, 3)  # an empty table entry
        _poll(box, mailbox.DONE, int(counter[0]))
        assert int(box[mailbox.BAD_CALL]) == 1
    finally:
        host_kernel.library().moe_host_worker_stop(worker)
