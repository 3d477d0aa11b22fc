"""Does programmatic dependent launch (PDL) shorten a decode-like chain of kernels in a CUDA graph?
A chain of 48 x (RMSNorm of one row, GEMV of that row with a distinct 5120 x 2048 bf16 weight),
captured once per mode and replayed back to back:
  off       plain launches
  pdl       launch_pdl=True; each kernel waits for its predecessor (gdc_wait) first thing
  prefetch  as pdl, and the GEMV loads its first weight tile before it waits
Checks the plain chain against torch (loosely: 48 roundings to bf16 apart) and every PDL mode
against the plain chain bit for bit, then prints us per replay.
  python3 scripts/probe_pdl.py [--layers 48]"""
import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from benchmarks.common import replay_us
from moeferry.engine.cuda_graph import capture


@triton.jit
def _norm_kernel(x_ptr, w_ptr, out_ptr, D: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.arange(0, D)
    x = tl.load(x_ptr + offs).to(tl.float32)
    w = tl.load(w_ptr + offs).to(tl.float32)
    rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + 1e-6)
    tl.store(out_ptr + offs, (x * rms * w).to(out_ptr.dtype.element_ty))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.arange(0, BK)
    w_ptrs = w_ptr + rows[:, None] * K + cols[None, :]
    first = tl.load(w_ptrs) if PREFETCH else tl.zeros((BN, BK), dtype=w_ptr.dtype.element_ty)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros((BN,), dtype=tl.float32)
    for k in range(0, K, BK):
        if PREFETCH and k == 0:
            w = first
        else:
            w = tl.load(w_ptrs + k)
        x = tl.load(x_ptr + k + cols)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rows < N)


def chain(x, norm_w, weights, outs, mode: str):
    pdl, prefetch = mode != "off", mode == "prefetch"
    h = x
    for w, (normed, y) in zip(weights, outs):
        _norm_kernel[(1,)](h[:2048], norm_w, normed, D=2048, PDL=pdl, launch_pdl=pdl)
        _gemv_kernel[(w.shape[0] // 4,)](normed, w, y, w.shape[0], K=2048, BN=4, BK=512, PDL=pdl,
                                         PREFETCH=prefetch, launch_pdl=pdl, num_warps=4)
        h = y
    return h


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=48)
    args = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    weights = [torch.randn(5120, 2048, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
    norm_w = torch.rand(2048, device=dev, dtype=torch.bfloat16) + 0.5
    x = torch.randn(2048, device=dev, dtype=torch.bfloat16)
    ref = x
    for w in weights:
        xf = ref[:2048].float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean() + 1e-6) * norm_w.float()).to(torch.bfloat16)
        ref = (w.float() @ normed.float()).to(torch.bfloat16)
    print(f"{'mode':<10} {'us/replay':>10} {'us/layer':>9} {'max err':>9}")
    floor_us = args.layers * 5120 * 2048 * 2 / 4.3e12 * 1e6
    plain = None
    for mode in ("off", "pdl", "prefetch", "off", "pdl", "prefetch"):
        outs = [(torch.empty(2048, device=dev, dtype=torch.bfloat16), torch.empty(5120, device=dev, dtype=torch.bfloat16))
                for _ in weights]
        graph, out = capture(lambda: chain(x, norm_w, weights, outs, mode))  # (its warm-up compiles)
        for o in outs:
            o[1].zero_()
        graph.replay()
        torch.cuda.synchronize()
        err = (out.float() - ref.float()).abs().max().item()
        assert err < 0.1 * ref.float().abs().max().item(), (mode, err)
        plain = out.clone() if plain is None else plain
        assert torch.equal(out, plain), mode
        us = replay_us(graph)
        print(f"{mode:<10} {us:>10.1f} {us / args.layers:>9.2f} {err:>9.2e}")
    print(f"floor (weights / 4.3 TB/s): {floor_us:.1f} us, {floor_us / args.layers:.2f} us/layer")


if __name__ == "__main__":
    main()
