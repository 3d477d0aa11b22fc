"""Attention kernels against the plain-torch oracle (kernels/attention/reference.py).

The Triton decode kernel runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py). The
oracle always runs in fp32 on the same (rounded) inputs, so a bf16 case measures only the
kernel's own rounding (P cast to bf16 before P @ V, the output cast). Every output element
is compared, the output and the split workspace start as NaN, and every cache slot the
kernel must not read holds a large poison value that would show in any output it touched.
"""
import pytest
import torch

from moeferry.engine.cuda_graph import capture
from moeferry.kernels import attention as attn_ops
from moeferry.kernels.attention import reference
from moeferry.kernels.attention import triton as triton_attn

POISON = 1000.0
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def make_decode_case(seed, batch, q_heads, kv_heads, head_dim, page_size, max_pages, lens, dtype,
                     device="cpu"):
    """A paged cache whose requests own pages scattered at random over the pool.

    Slots holding a live token get random values; everything else (the tail of each last
    page, unowned pages, the scratch page that pads each page table) holds POISON."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = batch * max_pages + 3
    scratch = num_pages
    k = torch.full(((num_pages + 1) * page_size, kv_heads, head_dim), POISON)
    v = torch.full_like(k, -POISON)
    pages = torch.randperm(num_pages, generator=gen)
    table = torch.full((batch, max_pages), scratch, dtype=torch.int32)
    for b, n in enumerate(lens):
        owned = pages[b * max_pages: b * max_pages + -(-n // page_size)]
        table[b, : owned.numel()] = owned.int()
        slots = (owned[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        k[slots] = torch.randn(n, kv_heads, head_dim, generator=gen)
        v[slots] = torch.randn(n, kv_heads, head_dim, generator=gen)
    q = torch.randn(batch, q_heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (q.to(dtype), k.to(dtype), v.to(dtype), table, seq_lens)]


def oracle_decode(q, k, v, table, seq_lens, page_size, scale, window):
    return reference.decode_attention(q.float(), k.float(), v.float(), table, seq_lens, page_size, scale, window)


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Split partials start as NaN, so a merge that read an unwritten one would show."""
    real = triton_attn._workspace

    def nan_workspace(*args):
        part_o, part_lse = real(*args)
        return part_o.fill_(float("nan")), part_lse.fill_(float("nan"))

    monkeypatch.setattr(triton_attn, "_workspace", nan_workspace)


# (batch, q_heads, kv_heads, head_dim, page_size, max_pages, lens, window, dtype, num_splits)
DECODE_CASES = [
    (1, 4, 4, 16, 16, 4, [64], None, torch.float32, 1),               # MHA, one full table
    (3, 4, 2, 32, 4, 12, [1, 29, 48], None, torch.float32, 2),        # length 1, full last page
    (4, 8, 2, 16, 16, 5, [80, 1, 33, 16], 8, torch.float32, 4),       # window inside one page
    (2, 8, 2, 32, 5, 9, [45, 23], 20, torch.float32, 4),              # page size 5, window > page
    (5, 4, 1, 16, 8, 6, [1, 2, 8, 47, 48], None, torch.float32, 8),   # MQA, more splits than blocks
    (2, 4, 1, 32, 16, 40, [640, 401], None, torch.float32, 2),        # several blocks per split
    (2, 4, 1, 16, 16, 40, [640, 300], 100, torch.float32, 2),         # window over a long context
    (3, 8, 2, 32, 16, 4, [64, 1, 17], None, torch.bfloat16, 1),
    (3, 4, 1, 16, 4, 12, [48, 13, 1], 7, torch.bfloat16, 4),
    (2, 8, 4, 32, 16, 3, [33, 48], 64, torch.bfloat16, 2),            # window longer than context
    (2, 4, 2, 16, 8, 4, [20, 32], None, torch.float16, 2),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"B{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-ps{c[4]}-w{c[7]}-"
                                                         f"{str(c[8])[6:]}-s{c[9]}")
def test_triton_decode_matches_reference(case, poisoned_workspace):
    batch, hq, hkv, d, ps, max_pages, lens, window, dtype, splits = case
    q, k, v, table, seq_lens = make_decode_case(len(lens) * 100 + d, batch, hq, hkv, d, ps, max_pages, lens, dtype)
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))
    got = triton_attn.decode_attention(q, k, v, table, seq_lens, ps, scale, window, num_splits=splits, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    want = oracle_decode(q, k, v, table, seq_lens, ps, scale, window)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


def test_split_count_comes_from_shapes_only():
    """Graph-safety: the launch never depends on seq_lens, and the default is a power of two."""
    cpu = torch.device("cpu")
    for batch in (1, 3, 64):
        for max_tokens in (16, 512, 32768):
            n = triton_attn.num_splits_for(batch, 4, max_tokens, cpu)
            assert n >= 1 and n & (n - 1) == 0 and n <= max(1, max_tokens // 256)
    assert triton_attn.num_splits_for(1, 4, 32768, cpu) > 1


def test_default_split_count_and_dispatch(poisoned_workspace):
    q, k, v, table, seq_lens = make_decode_case(7, 1, 4, 2, 16, 16, 32, [300], torch.float32)
    want = oracle_decode(q, k, v, table, seq_lens, 16, 0.25, None)
    got = attn_ops.decode_attention(q, k, v, table, seq_lens, 16, 0.25, impl="triton")
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    on_cpu = attn_ops.decode_attention(q, k, v, table, seq_lens, 16, 0.25)  # CPU tensors: the reference
    assert torch.equal(on_cpu, reference.decode_attention(q, k, v, table, seq_lens, 16, 0.25))


@pytest.mark.parametrize("splits", [1, 2])
def test_empty_row_is_zero(splits):
    """Length 0 is outside the contract, but gives a finite zero row rather than garbage."""
    q, k, v, table, seq_lens = make_decode_case(3, 2, 4, 2, 16, 4, 4, [9, 0], torch.float32)
    out = triton_attn.decode_attention(q, k, v, table, seq_lens, 4, 0.25, num_splits=splits,
                                       out=torch.full_like(q, float("nan")))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0], oracle_decode(q, k, v, table, seq_lens, 4, 0.25, None)[0])


# (tq, q_start, q_heads, kv_heads, head_dim, window, dtype)
PREFILL_CASES = [
    (37, 0, 8, 2, 32, None, torch.float32),     # whole prompt: is_causal, kv heads repeated (fp32)
    (37, 0, 8, 2, 32, None, torch.bfloat16),    # whole prompt: is_causal with enable_gqa
    (16, 0, 4, 4, 16, None, torch.float32),     # MHA
    (21, 40, 8, 2, 32, None, torch.float32),    # chunk after a prefix: explicit mask
    (1, 63, 4, 1, 16, None, torch.float32),     # one query after a prefix
    (37, 0, 8, 4, 16, 9, torch.float32),        # sliding window over a whole prompt
    (25, 30, 4, 2, 32, 12, torch.bfloat16),     # window after a prefix
]


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_sdpa_prefill_matches_reference(case):
    tq, q_start, hq, hkv, d, window, dtype = case
    gen = torch.Generator().manual_seed(tq + q_start)
    tk = q_start + tq
    q = torch.randn(tq, hq, d, generator=gen).to(dtype)
    k = torch.randn(tk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(tk, hkv, d, generator=gen).to(dtype)
    scale = d ** -0.5
    got = attn_ops.prefill_attention(q, k, v, q_start, scale, window, use_sdpa=True)
    assert got.shape == q.shape and got.dtype == dtype
    want = reference.prefill_attention(q.float(), k.float(), v.float(), q_start, scale, window)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("q_start, window, sinks", [(0, None, False), (30, None, False), (0, 9, False),
                                                   (30, None, True)])
def test_sdpa_prefill_runs_in_a_fused_kernel(q_start, window, sinks):
    """The fused kernels take only 4-D inputs; 3-D ones fall to the math kernel, which computes
    bf16 in float32 (on a GPU several times slower). With the math kernel ruled out, a whole
    prompt (grouped kv heads), a chunk after a prefix, a window and sinks still run, and match."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(q_start + 1)
    q = torch.randn(12, 8, 16, generator=gen).to(torch.bfloat16)
    k = torch.randn(q_start + 12, 2, 16, generator=gen).to(torch.bfloat16)
    v = torch.randn(q_start + 12, 2, 16, generator=gen).to(torch.bfloat16)
    sink_logits = torch.randn(8, generator=gen) if sinks else None
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        got = attn_ops.prefill_attention(q, k, v, q_start, 0.25, window, sink_logits, use_sdpa=True)
    want = reference.prefill_attention(q.float(), k.float(), v.float(), q_start, 0.25, window, sink_logits)
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])


# --- GPU: real sizes (Qwen3-30B-A3B attention: 32 q heads, 4 kv heads, head_dim 128, bf16) ---

QWEN3 = dict(q_heads=32, kv_heads=4, head_dim=128, page_size=16)


def _gpu_case(seed, lens, max_pages, dtype=torch.bfloat16):
    c = QWEN3
    return make_decode_case(seed, len(lens), c["q_heads"], c["kv_heads"], c["head_dim"], c["page_size"],
                            max_pages, lens, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("window", [None, 1024])
def test_triton_decode_gpu_real_sizes(batch, window):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 4097, (batch,), generator=gen).tolist()
    lens[0] = 4096
    if batch > 1:
        lens[1] = 1
    q, k, v, table, seq_lens = _gpu_case(batch, lens, 4096 // 16)
    got = attn_ops.decode_attention(q, k, v, table, seq_lens, 16, 128 ** -0.5, window)  # CUDA: Triton
    want = oracle_decode(q, k, v, table, seq_lens, 16, 128 ** -0.5, window)
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])
    for splits in (1, 8):
        got = triton_attn.decode_attention(q, k, v, table, seq_lens, 16, 128 ** -0.5, window, num_splits=splits)
        torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16])
def test_triton_decode_gpu_cuda_graph_replay(batch):
    """Captured once with short lengths, replayed with new lengths and tables in the static buffers."""
    max_pages = 4096 // 16
    q, k, v, table, seq_lens = _gpu_case(0, [1] * batch, max_pages)
    static_q, static_table, static_lens = q.clone(), table.clone(), seq_lens.clone()
    graph, static_out = capture(
        lambda: attn_ops.decode_attention(static_q, k, v, static_table, static_lens, 16, 128 ** -0.5))
    gen = torch.Generator().manual_seed(batch)
    for step in range(3):
        lens = torch.randint(1, 4097, (batch,), generator=gen).tolist()
        # Fresh caches per step would change pointers; rewrite the captured ones in place.
        nq, nk, nv, ntable, nlens = _gpu_case(step + 1, lens, max_pages)
        k.copy_(nk), v.copy_(nv), static_q.copy_(nq), static_table.copy_(ntable), static_lens.copy_(nlens)
        static_out.fill_(float("nan"))
        graph.replay()
        want = oracle_decode(nq, nk, nv, ntable, nlens, 16, 128 ** -0.5, None)
        torch.testing.assert_close(static_out.float(), want, **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("tq,q_start,window", [(2048, 0, None), (512, 1536, None), (1024, 0, 256), (1, 4095, None)])
def test_sdpa_prefill_gpu(tq, q_start, window):
    gen = torch.Generator().manual_seed(tq)
    tk = q_start + tq
    q = torch.randn(tq, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(tk, 4, 128, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(tk, 4, 128, generator=gen).to("cuda", torch.bfloat16)
    got = attn_ops.prefill_attention(q, k, v, q_start, 128 ** -0.5, window)
    want = reference.prefill_attention(q.float(), k.float(), v.float(), q_start, 128 ** -0.5, window)
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])
