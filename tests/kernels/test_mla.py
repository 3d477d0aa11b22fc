"""MLA decode attention (kernels/mla) against its plain-torch oracle, and the oracle against the
decompressed attention it replaces.

The Triton kernel runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py) at small sizes, every
tile axis of MLAConfig included, and at DeepSeek-V3's (128 heads, rank 512, rope 64, bf16, 1k-32k
tokens) on the GPU (-m gpu), the default tiles and a few explicit ones. Every slot a request
does not own holds a large poison value, the output and the split workspace start as NaN, and
every output element is compared.
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
    (4, 40, 16, 4, 8, 6, [1, 2, 47, 48], torch.float32, 8),          # 40 heads of 64 rows, more splits than blocks
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


C = triton_mla.MLAConfig
# (config, batch, heads, rank, rope, page_size, max_pages, lens, dtype, num_splits)
CONFIG_CASES = [
    (C(16, 16, 16, 4, 2), 2, 4, 64, 16, 16, 8, [100, 7], torch.float32, 2),          # four value blocks
    (C(16, 16, 16, 4, 1), 3, 5, 24, 8, 4, 20, [77, 1, 40], torch.float32, 4),        # last value block half masked
    (C(64, 16, 32, 4, 2), 2, 5, 32, 16, 16, 6, [90, 3], torch.float32, 1),           # 64-row tile, 5 heads
    (C(64, 32, 16, 8, 2), 2, 70, 16, 8, 8, 12, [95, 40], torch.float32, 2),          # a second, mostly masked block
    (C(16, 64, 32, 4, 3), 3, 4, 32, 16, 16, 12, [190, 64, 65], torch.float32, 2),    # 64 tokens a step
    (C(32, 64, 16, 4, 2), 2, 8, 32, 16, 16, 16, [256, 129], torch.bfloat16, 8),      # value blocks over 8 splits
    (C(16, 32, 64, 4, 2), 1, 16, 64, 16, 16, 24, [380], torch.bfloat16, 1),          # no value split, one split
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: f"h{c[0].block_h}-n{c[0].block_n}-v{c[0].block_v}-"
                                                                  f"r{c[3]}-H{c[2]}-s{c[9]}")
def test_every_tile_config_matches_the_reference(case, poisoned_workspace):
    """Value blocks (each writes its columns; the lse the merge reads comes from the first), head
    blocks wider than the heads, 64-token steps and several splits, against the oracle."""
    config, batch, heads, rank, rope, ps, max_pages, lens, dtype, splits = case
    q, cache, table, seq_lens = make_latent_case(7 + sum(lens), batch, heads, rank, rope, ps, max_pages, lens, dtype)
    scale = 0.9 * (rank + rope) ** -0.5
    out = torch.full((batch, heads, rank), float("nan"), dtype=dtype)
    triton_mla.mla_decode_attention(q, cache, table, seq_lens, ps, scale, rank, num_splits=splits, out=out,
                                    config=config)
    torch.testing.assert_close(out.float(), oracle(q, cache, table, seq_lens, ps, scale, rank), **TOL[dtype])


def test_the_wrapper_launches_select_configs_tiles(monkeypatch):
    """Without config=, the kernel runs select_config's tiles, on a grid of (head blocks x value
    blocks, B, splits) that launch_shape gives from the shapes."""
    launches = []
    kernel = triton_mla._mla_decode_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, kwargs))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_mla, "_mla_decode_kernel", Recording())
    batch, heads, rank, rope, ps, max_pages = 2, 40, 48, 16, 16, 6
    q, cache, table, seq_lens = make_latent_case(11, batch, heads, rank, rope, ps, max_pages, [96, 30], torch.bfloat16)
    got = triton_mla.mla_decode_attention(q, cache, table, seq_lens, ps, 0.2, rank)
    want = triton_mla.select_config(batch, heads, rank, max_pages * ps, torch.bfloat16)
    assert want == triton_mla.select_config(batch, heads, rank, max_pages * ps)  # bf16 is the default dtype
    programs, splits = triton_mla.launch_shape(batch, heads, rank, max_pages * ps, want, q.device)
    (grid, kwargs), = launches
    assert grid == (programs, batch, splits)
    assert (kwargs["BLOCK_H"], kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]) == (
        want.block_h, want.block_n, want.num_warps, want.num_stages)
    assert kwargs["BLOCK_V"] == min(want.block_v, 64) and kwargs["V_BLOCKS"] == -(-rank // kwargs["BLOCK_V"])
    torch.testing.assert_close(got.float(), oracle(q, cache, table, seq_lens, ps, 0.2, rank), **TOL[torch.bfloat16])


def test_select_config_narrows_the_default_to_small_calls_only():
    default = triton_mla.MLAConfig(**triton_mla.DEFAULT_TILES)
    one = triton_mla.MLAConfig(**triton_mla.ONE_REQUEST_TILES)
    assert triton_mla.select_config(64, 128, 512, 32768) == triton_mla.select_config(2, 128, 512, 4096) == default
    assert triton_mla.select_config(1, 128, 512, 32768) == one
    small = triton_mla.select_config(1, 4, 24, 20)
    assert (small.block_h, small.block_n, small.block_v) == (16, 32, 32)
    assert triton_mla.select_config(4, 128, 512, 4096, torch.float32).block_h == default.block_h // 2
    for bad in (C(48, 16, 16, 4, 2), C(16, 8, 16, 4, 2), C(128, 16, 16, 4, 2), C(16, 16, 16, 3, 2)):
        with pytest.raises(ValueError):
            bad.check()


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


V3_CONFIGS = [C(64, 32, 256, 8, 2), C(64, 32, 512, 8, 2), C(64, 16, 128, 8, 2), C(32, 64, 256, 8, 2),
              C(32, 16, 512, 8, 2), C(64, 32, 256, 4, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", V3_CONFIGS, ids=lambda c: f"h{c.block_h}-n{c.block_n}-v{c.block_v}-w{c.num_warps}"
                                                             f"-s{c.num_stages}")
@pytest.mark.parametrize("batch,context", [(2, 4096), (1, 32768)])
def test_triton_mla_decode_gpu_v3_sizes_every_config(config, batch, context):
    """The tiles benchmarks/sweep_mla.py tries, at the V3 shapes, with the default splits and one."""
    lens = [context, 1 + context // 3][:batch]
    q, cache, table, seq_lens = _v3_case(context + batch, lens, context // 16)
    scale = 192 ** -0.5
    want = oracle(q, cache, table, seq_lens, 16, scale, 512)
    for splits in (None, 1):
        got = triton_mla.mla_decode_attention(q, cache, table, seq_lens, 16, scale, 512, num_splits=splits,
                                              config=config)
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
