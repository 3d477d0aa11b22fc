"""Attention sinks (gpt-oss: a learned logit per query head in every row's softmax denominator)
on every path: the reference against HF's eager formula, the Triton decode kernel (under
TRITON_INTERPRET=1 on CPU) against the reference with one split and several, with windows; the
SDPA prefill's virtual sink key against the reference. GPU tests at gpt-oss-20b's attention
(64 q heads, 8 kv heads, head_dim 64)."""
import pytest
import torch

from moeferry.kernels import attention as attn_ops
from moeferry.kernels.attention import reference
from moeferry.kernels.attention import triton as triton_attn
from tests.kernels.test_attention import TOL, make_decode_case, poisoned_workspace  # noqa: F401


def make_sinks(q_heads, seed=11, device="cpu"):
    return (2.0 * torch.randn(q_heads, generator=torch.Generator().manual_seed(seed))).to(device)


def hf_eager(q, k, v, q_start, scale, window, sinks):
    """transformers' GptOss eager_attention_forward in float64, for one request's queries
    [Tq, Hq, D] at q_start over keys [Tk, Hkv, D]."""
    tq, hq, _ = q.shape
    rep = hq // k.shape[1]
    kk = k.double().repeat_interleave(rep, dim=1).transpose(0, 1)
    vv = v.double().repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kk.transpose(1, 2) * scale
    q_pos = torch.arange(q_start, q_start + tq)[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    combined = torch.cat([scores, sinks.double().view(hq, 1, 1).expand(hq, tq, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return (probs @ vv).transpose(0, 1)


@pytest.mark.parametrize("q_start,tq,window", [(0, 13, None), (6, 7, None), (0, 13, 4), (9, 4, 3)])
def test_reference_prefill_matches_hf_eager(q_start, tq, window):
    gen = torch.Generator().manual_seed(q_start + tq)
    q = torch.randn(tq, 4, 8, generator=gen)
    k = torch.randn(q_start + tq, 2, 8, generator=gen)
    v = torch.randn(q_start + tq, 2, 8, generator=gen)
    sinks = make_sinks(4)
    got = reference.prefill_attention(q, k, v, q_start, 8 ** -0.5, window, sinks)
    torch.testing.assert_close(got.double(), hf_eager(q, k, v, q_start, 8 ** -0.5, window, sinks), atol=1e-6, rtol=1e-5)
    without = reference.prefill_attention(q, k, v, q_start, 8 ** -0.5, window)
    assert (got - without).abs().max() > 1e-2  # the sinks matter


def test_reference_decode_is_the_last_row_of_prefill():
    lens = [23, 1, 9]
    q, k, v, table, seq_lens = make_decode_case(5, 3, 4, 2, 16, 4, 8, lens, torch.float32)
    sinks = make_sinks(4)
    got = reference.decode_attention(q, k, v, table, seq_lens, 4, 0.25, 6, sinks)
    for b, n in enumerate(lens):
        slots = (table[b].long()[:, None] * 4 + torch.arange(4)).flatten()[:n]
        want = hf_eager(q[b:b + 1], k[slots], v[slots], n - 1, 0.25, 6, sinks)[0]
        torch.testing.assert_close(got[b].double(), want, atol=1e-6, rtol=1e-5)


# (batch, q_heads, kv_heads, head_dim, page_size, max_pages, lens, window, dtype, num_splits)
SINK_CASES = [
    (3, 4, 2, 16, 4, 12, [1, 29, 48], None, torch.float32, 1),
    (3, 4, 2, 16, 4, 12, [1, 29, 48], None, torch.float32, 4),
    (4, 8, 2, 16, 16, 5, [80, 1, 33, 16], 8, torch.float32, 4),
    (2, 4, 1, 16, 16, 40, [640, 300], 100, torch.float32, 2),
    (3, 8, 2, 32, 16, 4, [64, 1, 17], 20, torch.bfloat16, 1),
    (3, 8, 2, 32, 16, 4, [64, 1, 17], None, torch.bfloat16, 2),
]


@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: f"B{c[0]}-w{c[7]}-{str(c[8])[6:]}-s{c[9]}")
def test_triton_decode_with_sinks_matches_reference(case, poisoned_workspace):  # noqa: F811
    batch, hq, hkv, d, ps, max_pages, lens, window, dtype, splits = case
    q, k, v, table, seq_lens = make_decode_case(len(lens) * 10 + d, batch, hq, hkv, d, ps, max_pages, lens, dtype)
    sinks = make_sinks(hq)
    got = triton_attn.decode_attention(q, k, v, table, seq_lens, ps, d ** -0.5, window, sinks, num_splits=splits,
                                       out=torch.full_like(q, float("nan")))
    want = reference.decode_attention(q.float(), k.float(), v.float(), table, seq_lens, ps, d ** -0.5, window, sinks)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


def test_triton_decode_refuses_sinks_of_the_wrong_shape():
    q, k, v, table, seq_lens = make_decode_case(1, 1, 4, 2, 16, 4, 2, [5], torch.float32)
    with pytest.raises(ValueError, match="sinks"):
        triton_attn.decode_attention(q, k, v, table, seq_lens, 4, 0.25, None, torch.zeros(2))


@pytest.mark.parametrize("tq,q_start,window,dtype", [(13, 0, None, torch.float32), (7, 9, None, torch.float32),
                                                     (19, 0, 5, torch.float32), (9, 6, 4, torch.bfloat16)])
def test_sdpa_prefill_with_a_virtual_sink_key_matches_reference(tq, q_start, window, dtype):
    gen = torch.Generator().manual_seed(tq)
    q = torch.randn(tq, 8, 16, generator=gen).to(dtype)
    k = torch.randn(q_start + tq, 2, 16, generator=gen).to(dtype)
    v = torch.randn(q_start + tq, 2, 16, generator=gen).to(dtype)
    sinks = make_sinks(8)
    got = attn_ops.prefill_attention(q, k, v, q_start, 0.25, window, sinks, use_sdpa=True)
    assert got.shape == q.shape and got.dtype == dtype
    want = reference.prefill_attention(q.float(), k.float(), v.float(), q_start, 0.25, window, sinks)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


# --- GPU: gpt-oss-20b's attention (64 q heads, 8 kv heads, head_dim 64, window 128) ----------

@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("window", [None, 128])
def test_triton_decode_with_sinks_gpu_real_sizes(batch, window):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 4097, (batch,), generator=gen).tolist()
    lens[0] = 4096
    q, k, v, table, seq_lens = make_decode_case(batch, batch, 64, 8, 64, 16, 256, lens, torch.bfloat16, "cuda")
    sinks = make_sinks(64, device="cuda")
    want = reference.decode_attention(q.float(), k.float(), v.float(), table, seq_lens, 16, 0.125, window, sinks)
    for splits in (None, 1, 8):
        got = triton_attn.decode_attention(q, k, v, table, seq_lens, 16, 0.125, window, sinks, num_splits=splits)
        torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("tq,q_start,window", [(2048, 0, None), (512, 1536, None), (1024, 0, 128)])
def test_sdpa_prefill_with_sinks_gpu(tq, q_start, window):
    gen = torch.Generator().manual_seed(tq)
    q = torch.randn(tq, 64, 64, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(q_start + tq, 8, 64, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(q_start + tq, 8, 64, generator=gen).to("cuda", torch.bfloat16)
    sinks = make_sinks(64, device="cuda")
    got = attn_ops.prefill_attention(q, k, v, q_start, 0.125, window, sinks)
    want = reference.prefill_attention(q.float(), k.float(), v.float(), q_start, 0.125, window, sinks)
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])
