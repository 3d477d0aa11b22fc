"""The fused MoE GEMM kernel compiles for an H100/H200 (sm_90) in every weight format, on a
machine without a GPU (4-bit banks as split-field dots, MXFP4's as bytes and as int32 words,
gpt-oss's biases and clamped SwiGLU too): Triton's compiler and ptxas ship with the triton
wheel, and they type what TRITON_INTERPRET=1 never does (a return's type behind a constexpr, a
bitcast, an integer width). Run in a subprocess, since this process' kernels were made for the
interpreter. The MLA decode kernel's tiles compile too; ptxas' report (registers, spills) of
each kernel is printed."""

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

PTXAS = r"""
import contextlib, inspect, io, os, re, sys
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas -v's report goes to stdout, read back below
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_reported(source, options):  # for sm_90: the kernel, and ptxas' registers and spills
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    regs = re.search(r"Used (\d+) registers", log.getvalue()).group(1)
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue()).groups()
    return compiled, f"registers={regs} spill_stores={stores} spill_loads={loads}"
"""

COMPILE = PTXAS + r"""
from moeferry.kernels.fused_moe.triton import _moe_gemm_kernel as kernel

FORMATS = {  # weight, scale pointer, constexprs
    "bf16": ("bf16", "fp32", dict(QUANT=False, PACKED=False, PACK=1, MXFP4=False, SCALE_BN=1, SCALE_BK=1)),
    "fp8": ("fp8e4nv", "fp32", dict(QUANT=True, PACKED=False, PACK=1, MXFP4=False, SCALE_BN=128, SCALE_BK=128)),
    "int4": ("i32", "fp32", dict(QUANT=True, PACKED=True, PACK=8, MXFP4=False, SCALE_BN=1, SCALE_BK=128)),
    "mxfp4": ("u8", "u8", dict(QUANT=False, PACKED=False, PACK=2, MXFP4=True, SCALE_BN=1, SCALE_BK=32)),
    "int4-split": ("i32", "fp32", dict(QUANT=True, PACKED=True, PACK=8, MXFP4=False, SCALE_BN=1, SCALE_BK=128,
                                      SPLIT=True)),
    "mxfp4-split": ("u8", "u8", dict(QUANT=False, PACKED=False, PACK=2, MXFP4=True, SCALE_BN=1, SCALE_BK=32,
                                     SPLIT=True, BLOCK_K=32)),  # a split tile of bytes is one scale block
    "mxfp4-words": ("i32", "u8", dict(QUANT=False, PACKED=False, PACK=8, MXFP4=True, SCALE_BN=1, SCALE_BK=32,
                                     SPLIT=True)),  # the bytes as int32 words: four scale blocks a tile
    "bf16-biased-clamped": ("bf16", "fp32", dict(QUANT=False, PACKED=False, PACK=1, MXFP4=False, SCALE_BN=1,
                                                 SCALE_BK=1, BIAS=True, CLAMPED=True)),
}
SCALARS = dict(alpha="fp32", limit="fp32")
params = list(inspect.signature(kernel.fn).parameters)
for name in sys.argv[1:]:
    weight, scale, constexprs = FORMATS[name]
    for gated in (True, False):
        values = dict(BIAS=False, CLAMPED=False, SPLIT=False, A_ROWS_PER_ROUTE_DIV=8 if gated else 1, GATED=gated,
                      WEIGHTED=not gated, NAIVE=False, IEEE=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1,
                      PDL=False)
        values.update(constexprs)
        values.update(stride_ak=1, stride_bk=1, stride_cn=1)  # as a launch specialises contiguous rows
        pointers = dict(a_ptr="*bf16", b_ptr="*" + weight, c_ptr="*bf16", route_weight_ptr="*fp32",
                        sorted_route_ptr="*i32", block_expert_ptr="*i32", num_post_padded_ptr="*i32", ids_ptr="*i32",
                        scale_ptr="*" + scale, bias_ptr="*bf16", **SCALARS)
        signature = {p: "constexpr" if p in values else pointers.get(p, "i32") for p in params}
        aligned = [p for p in params if signature[p].startswith("*")]  # the allocators' 16-byte alignment
        source = ASTSource(kernel, signature, constexprs={(params.index(p),): v for p, v in values.items()},
                           attrs={(params.index(p),): [["tt.divisibility", 16]] for p in aligned})
        _, report = compile_reported(source, {"num_warps": 4, "num_stages": 3})
        print(name, "gate+up" if gated else "down", report)
    print(name, "compiled")
"""


def _compiled(script: str, *args: str, cache_dir=None) -> str:
    """Run `script` with `args` in a fresh process without the interpreter (`cache_dir`: a fresh
    Triton cache, since a cached kernel runs no ptxas and so reports nothing); its stdout.
    Skips where the triton wheel brings no ptxas."""
    import triton

    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("the triton wheel brings no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parents[2])
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = str(cache_dir)
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("weight_format", ["bf16", "fp8", "int4", "mxfp4", "int4-split", "mxfp4-split",
                                           "mxfp4-words", "bf16-biased-clamped"])
def test_the_fused_moe_gemm_compiles_for_sm90(weight_format, tmp_path):
    """Both GEMMs (gate+up, down) at the decode tiles (16 x 64 x 128, 4 warps, 3 stages), unit
    strides along K and aligned pointers as a launch specialises them; ptxas' registers and
    spills of each are in the output (pytest -s)."""
    assert f"{weight_format} compiled" in _compiled(COMPILE, weight_format, cache_dir=tmp_path)


GEMV = PTXAS + r"""
from moeferry.kernels.fused_moe.gemv import FP8, INT4, MXFP4, PLAIN, _route_gemv_kernel as kernel, select_gemv_config
import torch

FORMATS = {  # weight, scale pointer, stored dtype (the tiles), constexprs
    "bf16": ("bf16", "fp32", torch.bfloat16, dict(FORMAT=PLAIN.value, PACK=1, GROUP=1, SCALE_BN=1)),
    "fp8": ("fp8e4nv", "fp32", torch.float8_e4m3fn, dict(FORMAT=FP8.value, PACK=1, GROUP=128, SCALE_BN=128)),
    "int4": ("i32", "fp32", torch.int32, dict(FORMAT=INT4.value, PACK=8, GROUP=128, SCALE_BN=1)),
    "mxfp4": ("i32", "u8", torch.uint8, dict(FORMAT=MXFP4.value, PACK=8, GROUP=32, SCALE_BN=1)),
    "int4-int8": ("i32", "fp32", torch.int32, dict(FORMAT=INT4.value, PACK=8, GROUP=128, SCALE_BN=1, INT8=True)),
}
ALIGNED_INTS = ("stride_am", "stride_be", "stride_bn", "stride_cm", "k_in", "n_out", "stride_se", "stride_bias_e")
params = list(inspect.signature(kernel.fn).parameters)
for name in sys.argv[1:]:
    weight, scale, stored, constexprs = FORMATS[name]
    # each distinct tile of the rows of Qwen3-30B-A3B (96 words of 4-bit values) and gpt-oss-20b (360)
    for gated, tiles in dict.fromkeys((g, select_gemv_config(g, stored, row)) for g, row in ((True, 96), (False, 96),
                                                                                         (False, 360))):
        values = dict(A_ROWS_PER_ROUTE_DIV=8 if gated else 1, GATED=gated, WEIGHTED=not gated, BIAS=gated,
                      CLAMPED=gated, BLOCK_N=tiles.block_n, STEP=tiles.step, EVEN=gated, PDL=True, INT8=False)
        values.update(constexprs)
        pointers = dict(a_ptr="*bf16", b_ptr="*" + weight, c_ptr="*bf16", route_weight_ptr="*fp32", ids_ptr="*i32",
                        scale_ptr="*" + scale, bias_ptr="*bf16", alpha="fp32", limit="fp32")
        signature = {p: "constexpr" if p in values else pointers.get(p, "i32") for p in params}
        aligned = [p for p in params if signature[p].startswith("*") or p in ALIGNED_INTS]  # as a launch specialises
        source = ASTSource(kernel, signature, constexprs={(params.index(p),): v for p, v in values.items()},
                           attrs={(params.index(p),): [["tt.divisibility", 16]] for p in aligned})
        _, report = compile_reported(source, {"num_warps": tiles.num_warps, "num_stages": 1,
                                              "enable_fp_fusion": not values["INT8"]})
        print(name, "gate+up" if gated else "down", report)
        assert re.search(r"spill_stores=0 ", report + " "), report
    print(name, "compiled")
"""


@pytest.mark.slow
@pytest.mark.parametrize("weight_format", ["bf16", "fp8", "int4", "mxfp4", "int4-int8"])
def test_the_route_gemv_compiles_for_sm90_without_spills(weight_format, tmp_path):
    """Both GEMMs at their chosen tiles (the gated one with gpt-oss's biases and clamped SwiGLU and
    no masks, the down GEMM masked), PDL on, int4's int8 path too (dp4a); ptxas' registers in the
    output (pytest -s)."""
    assert f"{weight_format} compiled" in _compiled(GEMV, weight_format, cache_dir=tmp_path)


SMALL = r"""
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moeferry.kernels.host_mailbox.triton import _post_request_kernel, _wait_done_kernel
from moeferry.kernels.host_staging.triton import _staged_copy_kernel, _staged_routes_kernel
from moeferry.kernels.generated_routes.triton import _draw_kernel, _force_kernel, _oracle_kernel
from moeferry.kernels.route_split.triton import _split_routes_kernel
from moeferry.kernels.timestamps.triton import _stamp_kernel

KERNELS = [  # kernel, pointer types, constexprs
    (_post_request_kernel, dict(box_ptr="*i64", counter_ptr="*i64", work_ptr="*i64", src0="*bf16", dst0="*bf16",
                                src1="*i64", dst1="*i32", src2="*fp32", dst2="*fp32"),
     dict(REQUEST_WORD=0, CALL_WORD=1, HAS_WORK=True, STAGED_PAIRS=3, WORK_BLOCK=256, STAGE_BLOCK=1024, PDL=True)),
    (_wait_done_kernel, dict(box_ptr="*i64", counter_ptr="*i64"),
     dict(DONE_WORD=8, STALLED_WORD=1, CONFIRMED_WORD=2, PDL=True)),
    (_staged_copy_kernel, dict(src0="*bf16", dst0="*bf16", src1="*i64", dst1="*i32", src2="*fp32", dst2="*fp32"),
     dict(BLOCK=1024, PDL=True)),
    (_staged_routes_kernel, dict(src_ptr="*bf16", dst_ptr="*bf16", ids_ptr="*i64"),
     dict(KEEP=True, BLOCK=1024, PDL=True)),
    (_stamp_kernel, dict(times_ptr="*i64", counter_ptr="*i64"), dict(ADVANCE=True, PDL=True)),
    (_split_routes_kernel, dict(ids_ptr="*i64", slot_ptr="*i32", host_ids_ptr="*i64", device_ids_ptr="*i64",
                                count_ptr="*i64", rotation_ptr="*i64", tally_ptr="*i64", flags_ptr="*i32",
                                split_ptr="*fp32", weights_ptr="*fp32", device_weights_ptr="*fp32"),
     dict(BLOCK_E=128, BLOCK_R=256, HAS_TALLY=True, HAS_WEIGHTS=True, PDL=True)),
    (_draw_kernel, dict(fixed_ptr="*fp32", gumbel_ptr="*i64", keep_ptr="*i64", step_ptr="*i64", routes_ptr="*i64",
                        keep="fp32"),
     dict(K=8, BLOCK_E=128, BLOCK_K=8, KEEP=True, BIG_VALUE=1e4, PDL=True)),
    (_oracle_kernel, dict(wrong_ptr="*i64", keep_ptr="*i64", step_ptr="*i64", true_ptr="*i64", out_ptr="*i64",
                          recall="fp32"),
     dict(K=8, WIDTH=8, BLOCK_E=128, BLOCK_K=8, BLOCK_W=8, PDL=True)),
    (_force_kernel, dict(logits_ptr="*bf16", ids_ptr="*i64", out_ptr="*bf16"),
     dict(K=8, BLOCK_E=128, BLOCK_K=8, OFF=-1e4, PDL=True)),
]
for kernel, pointers, constexprs in KERNELS:
    params = list(inspect.signature(kernel.fn).parameters)
    signature = {p: "constexpr" if p in constexprs else pointers.get(p, "i32") for p in params}
    source = ASTSource(kernel, signature, constexprs={(params.index(p),): v for p, v in constexprs.items()})
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    print(kernel.fn.__name__, "compiled")
"""


@pytest.mark.slow
def test_the_host_channel_kernels_compile_for_sm90():
    """The mailbox's post (a pass over its work, staged copies behind a barrier, a system-scope
    release exchange) and wait (volatile polls of host memory), the staging copies, the
    timestamp (inline PTX reading %globaltimer), the route split (barriers around a scratch row,
    a cumulative sum) and the generated routes' draw (a uint32 hash), oracle and forcing, with
    PDL."""
    stdout = _compiled(SMALL)
    for name in ("_post_request_kernel", "_wait_done_kernel", "_staged_copy_kernel", "_staged_routes_kernel",
                 "_stamp_kernel", "_split_routes_kernel", "_draw_kernel", "_oracle_kernel", "_force_kernel"):
        assert f"{name} compiled" in stdout


MLA = PTXAS + r"""
from moeferry.kernels.mla.triton import MLAConfig, _mla_decode_kernel as kernel

params = list(inspect.signature(kernel.fn).parameters)
pointers = dict(q_ptr="*bf16", c_ptr="*bf16", pt_ptr="*i32", lens_ptr="*i32", out_ptr="*bf16", part_o_ptr="*fp32",
                part_lse_ptr="*fp32", qk_scale="fp32")
for item in sys.argv[1:]:
    config = MLAConfig(*map(int, item.split(",")))
    values = dict(NUM_HEADS=128, RANK=512, ROPE=64, PAGE_SIZE=16, NUM_SPLITS=2, V_BLOCKS=512 // config.block_v,
                  BLOCK_H=config.block_h, BLOCK_N=config.block_n, BLOCK_R=512, BLOCK_V=config.block_v, BLOCK_P=64,
                  IEEE=False, PDL=True)
    signature = {p: "constexpr" if p in values else pointers.get(p, "i32") for p in params}
    # what a launch at V3's shapes specialises: aligned pointers, strides and lengths multiples of 16
    aligned = [p for p in params if p not in values and p not in ("qk_scale", "stride_plh")]
    source = ASTSource(kernel, signature, constexprs={(params.index(p),): v for p, v in values.items()},
                       attrs={(params.index(p),): [["tt.divisibility", 16]] for p in aligned})
    compiled, report = compile_reported(source, {"num_warps": config.num_warps, "num_stages": config.num_stages})
    print(item, "compiled", report, f"shared={compiled.metadata.shared}")
"""
H100_SHARED_BYTES = 227 * 1024  # the most one block may take on sm_90


@pytest.mark.slow
def test_the_mla_decode_kernel_compiles_for_sm90_and_the_defaults_fit_a_block(tmp_path):
    """At DeepSeek-V3's shapes: select_config's defaults (many requests, one request) and the
    many-request tile with half and a quarter of the value columns; ptxas' registers and spills
    per tile are in the output (pytest -s). The many-request default spills a few bytes (the
    sweep measured it fastest all the same); neither spills more than a few words, and both
    fit one block's shared memory."""
    from moeferry.kernels.mla.triton import select_config

    default = select_config(64, 128, 512, 32768)
    tiles = [default, select_config(1, 128, 512, 32768), *(dataclasses.replace(default, block_v=v) for v in (256, 128))]
    items = [",".join(str(getattr(t, f.name)) for f in dataclasses.fields(t)) for t in tiles]
    stdout = _compiled(MLA, *items, cache_dir=tmp_path)
    report = {line.split()[0]: dict(kv.split("=") for kv in line.split()[2:]) for line in stdout.splitlines()
              if " compiled " in line}
    assert set(report) == set(items)
    for item in items[:2]:
        assert int(report[item]["spill_stores"]) <= 64 and int(report[item]["shared"]) <= H100_SHARED_BYTES, report
