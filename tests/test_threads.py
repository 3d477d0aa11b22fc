"""The engine's steps run with its own intra-op thread count, whatever thread drives them
(the offline API on the main thread, the server's engine thread), and the caller's count is
restored afterwards; the host expert kernel's pool is sized from the count moeferry loaded with."""

import threading

import torch

from moeferry.kernels.fused_moe import host
from moeferry.threads import ENGINE_INTRA_OP_THREADS, HOST_THREADS, engine_threads


def test_the_engine_scope_sets_its_count_and_restores_the_callers():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with engine_threads():
            assert torch.get_num_threads() == ENGINE_INTRA_OP_THREADS
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_host_kernels_pool_does_not_follow_the_engine_scope():
    outside = host.default_threads()
    with engine_threads():
        assert host.default_threads() == outside
    assert outside == (HOST_THREADS - 1 if HOST_THREADS > 2 else HOST_THREADS)


def test_generate_runs_its_steps_in_the_engine_scope_on_any_thread(model_cache, monkeypatch):
    from moeferry.llm import LLM, SamplingParams

    llm = LLM(dtype="float32", device="cpu", max_model_len=64)
    seen = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (seen.append(torch.get_num_threads()), step())[1])
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    main = llm.generate("hello", params)[0].token_ids
    worker = []
    thread = threading.Thread(target=lambda: worker.append(llm.generate("hello", params)[0].token_ids))
    thread.start()
    thread.join()
    assert seen and set(seen) == {ENGINE_INTRA_OP_THREADS}
    assert worker == [main]
