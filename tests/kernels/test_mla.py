"""MLA decode attention (kernels/mla) against its plain-torch oracle, and the oracle against the
decompressed attention it replaces.

The Triton kernel runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py) at small sizes, and
at DeepSeek-V3's (128 heads, rank 512, rope 64, bf16, 1k-32k tokens) on the GPU (-m gpu). Every
slot a request does not own holds a large poison value, the output and the split workspace
start as NaN, and every output element is compared.
"""
import pytest
import torch

from moeferry.engine.cuda_graph import capture
from moeferry.kernels import mla as mla_ops
from moeferry.kernels.attention import reference as attn_reference
from moeferry.kernels.attention import triton as triton_attn
from moeferry.kernels.mla import reference
from moeferry.kernels.mla import triton as triton_mla

POISON = 1000.0
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_latent_case(seed, batch, heads, rank, rope, page_size, max_pages, lens, dtype, device="cpu"):
    """A paged latent cache [slots, 1, rank + rope], requests' pages scattered over the pool, and
    the absorbed queries [B, H, rank + rope]; unowned slots hold POISON."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = batch * max_pages + 3
    cache = torch.full(((num_pages + 1) * page_size, 1, rank + rope), POISON)
    pages = torch.randperm(num_pages, generator=gen)
    table = torch.full((batch, max_pages), num_pages, dtype=torch.int32)
    for b, n in enumerate(lens):
        owned = pages[b * max_pages: b * max_pages + -(-n // page_size)]
        table[b, : owned.numel()] = owned.int()
        slots = (owned[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        cache[slots] = torch.randn(n, 1, rank + rope, generator=gen)
    q = torch.randn(batch, heads, rank + rope, generator=gen) * 0.3
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (q.to(dtype), cache.to(dtype), table, seq_lens)]


def oracle(q, cache, table, seq_lens, page_size, scale, rank):
    return reference.mla_decode_attention(q.float(), cache.float(), table, seq_lens, page_size, scale, rank)


@pytest.fixture
def poisoned_workspace(monkeypatch):
    real = triton_attn._workspace

    def nan_workspace(*args):
        part_o, part_lse = real(*args)
        return part_o.fill_(float("nan")), part_lse.fill_(float("nan"))

    monkeypatch.setattr(triton_mla, "_workspace", nan_workspace)


# (batch, heads, rank, rope, page_size, max_pages, lens, dtype, num_splits)
CASES = [
    (1, 4, 16, 8, 16, 4, [64], torch.float32, 1),
    (3, 5, 32, 16, 4, 12, [1, 29, 48], torch.float32, 2),            # heads not a power of two
    (4, 40, 16, 4, 8, 6, [1, 2, 47, 48], torch.float32, 8),          # two head blocks, more splits than blocks
    (2, 4, 24, 8, 5, 70, [345, 200], torch.float32, 2),              # rank not a power of two, page 5
    (3, 8, 32, 16, 16, 4, [64, 1, 17], torch.bfloat16, 1),
    (2, 16, 64, 16, 16, 24, [380, 33], torch.bfloat16, 4),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-h{c[1]}-r{c[2]}+{c[3]}-ps{c[4]}-{str(c[7])[6:]}-s{c[8]}")
def test_triton_mla_decode_matches_reference(case, poisoned_workspace):
    batch, heads, rank, rope, ps, max_pages, lens, dtype, splits = case
    q, cache, table, seq_lens = make_latent_case(sum(lens), batch, heads, rank, rope, ps, max_pages, lens, dtype)
    scale = 0.7 * (rank + rope) ** -0.5
    out = torch.full((batch, heads, rank), float("nan"), dtype=dtype)
    got = triton_mla.mla_decode_attention(q, cache, table, seq_lens, ps, scale, rank, num_splits=splits, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    torch.testing.assert_close(got.float(), oracle(q, cache, table, seq_lens, ps, scale, rank), **TOL[dtype])


def test_dispatch_takes_the_reference_on_cpu_and_triton_when_named():
    q, cache, table, seq_lens = make_latent_case(3, 2, 4, 16, 8, 16, 20, [300, 7], torch.float32)
    want = reference.mla_decode_attention(q, cache, table, seq_lens, 16, 0.3, 16)
    assert torch.equal(mla_ops.mla_decode_attention(q, cache, table, seq_lens, 16, 0.3, 16), want)
    got = mla_ops.mla_decode_attention(q, cache, table, seq_lens, 16, 0.3, 16, impl="triton")
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_absorbed_attention_equals_the_decompressed_attention():
    """The oracle's premise: with q_lat = W_UK^T q_nope, attention over the latent rows followed
    by W_UV gives what attention over decompressed keys [W_UK c, k_pe] and values W_UV c gives."""
    gen = torch.Generator().manual_seed(5)
    heads, rank, rope, nope, v_dim, page_size, n = 6, 24, 8, 12, 10, 4, 37
    q, cache, table, seq_lens = make_latent_case(5, 1, heads, rank, rope, page_size, 10, [n], torch.float64)
    q_nope, q_pe = torch.randn(1, heads, nope, generator=gen, dtype=torch.float64), q[..., rank:]
    w_uk = torch.randn(heads, nope, rank, generator=gen, dtype=torch.float64)
    w_uv = torch.randn(heads, v_dim, rank, generator=gen, dtype=torch.float64)
    scale = (nope + rope) ** -0.5
    q_abs = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w_uk), q_pe], dim=-1)
    absorbed = torch.einsum("bhr,hvr->bhv", reference.mla_decode_attention(q_abs, cache, table, seq_lens, page_size,
                                                                           scale, rank), w_uv)
    slots = (table[0].long()[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
    c, k_pe = cache[slots, 0, :rank], cache[slots, 0, rank:]
    k = torch.cat([torch.einsum("hnr,tr->thn", w_uk, c), k_pe[:, None].expand(n, heads, rope)], dim=-1)
    v = torch.einsum("hvr,tr->thv", w_uv, c)
    q_full = torch.cat([q_nope, q_pe], dim=-1)
    decompressed = attn_reference.prefill_attention(q_full, k, v, n - 1, scale)
    torch.testing.assert_close(absorbed, decompressed, rtol=1e-10, atol=1e-10)


def test_the_split_count_comes_from_shapes_only():
    cpu = torch.device("cpu")
    for batch in (1, 16, 64):
        for tokens in (1024, 32768):
            config = triton_mla.select_config(batch, 128, 512, tokens)
            _, n = triton_mla.launch_shape(batch, 128, 512, tokens, config, cpu)
            assert n >= 1 and n & (n - 1) == 0


# --- GPU: DeepSeek-V3's MLA (128 heads, kv_lora_rank 512, rope 64, bf16, page 16) ------------

V3 = dict(heads=128, rank=512, rope=64, page_size=16)


def _v3_case(seed, lens, max_pages):
    c = V3
    return make_latent_case(seed, len(lens), c["heads"], c["rank"], c["rope"], c["page_size"], max_pages, lens,
                            torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("batch,context", [(1, 1024), (1, 32768), (16, 4096), (64, 1024), (8, 32768)])
def test_triton_mla_decode_gpu_v3_sizes(batch, context):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, context + 1, (batch,), generator=gen).tolist()
    lens[0] = context
    if batch > 1:
        lens[1] = 1
    q, cache, table, seq_lens = _v3_case(batch, lens, context // 16)
    scale = 192 ** -0.5
    want = oracle(q, cache, table, seq_lens, 16, scale, 512)
    got = mla_ops.mla_decode_attention(q, cache, table, seq_lens, 16, scale, 512)  # CUDA: Triton
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])
    for splits in (1, 8):
        got = triton_mla.mla_decode_attention(q, cache, table, seq_lens, 16, scale, 512, num_splits=splits)
        torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])


@pytest.mark.gpu
def test_triton_mla_decode_gpu_cuda_graph_replay():
    """Captured once with length 1, replayed with new lengths and tables in the static buffers."""
    batch, max_pages = 4, 4096 // 16
    q, cache, table, seq_lens = _v3_case(0, [1] * batch, max_pages)
    static_q, static_table, static_lens = q.clone(), table.clone(), seq_lens.clone()
    graph, static_out = capture(lambda: mla_ops.mla_decode_attention(static_q, cache, static_table, static_lens, 16,
                                                                     0.1, 512))
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        lens = torch.randint(1, 4097, (batch,), generator=gen).tolist()
        nq, ncache, ntable, nlens = _v3_case(step + 1, lens, max_pages)
        cache.copy_(ncache), static_q.copy_(nq), static_table.copy_(ntable), static_lens.copy_(nlens)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(static_out.float(), oracle(nq, ncache, ntable, nlens, 16, 0.1, 512),
                                   **TOL[torch.bfloat16])
