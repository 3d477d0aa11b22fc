"""Every Triton kernel of the engine may be launched with programmatic dependent launch
(kernels/triton/common.py): each takes PDL and calls wait_for_previous_kernel(PDL) before any
other statement, so that no kernel touches memory before the one before it has finished; and
pdl_launch asks for PDL only on a CUDA device. (PDL on the GPU: tests/engine/test_pdl_gpu.py.)
Kernels live in kernels/triton/*.py and, one folder per op, in kernels/<op>/triton.py."""
import ast
import pathlib

import torch

import moeferry.kernels.triton as triton_kernels
from moeferry.kernels.triton.common import pdl_launch


def _kernel_modules():
    kernels = pathlib.Path(triton_kernels.__file__).parent.parent
    return sorted(kernels.glob("triton/*.py")) + sorted(kernels.glob("*/triton.py"))


def _jit_kernels():
    for path in _kernel_modules():
        for node in ast.parse(path.read_text()).body:
            jitted = isinstance(node, ast.FunctionDef) and any("triton.jit" in ast.unparse(d)
                                                               for d in node.decorator_list)
            if jitted and node.name.startswith("_") and node.name.endswith("_kernel"):
                yield f"{path.parent.name}/{path.name}:{node.name}", node


def test_every_kernel_waits_for_the_previous_one_before_anything_else():
    kernels = dict(_jit_kernels())
    assert len(kernels) >= 15, sorted(kernels)
    for name, fn in kernels.items():
        assert fn.args.args[-1].arg == "PDL", name
        body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
        assert ast.unparse(body[0]) == "wait_for_previous_kernel(PDL)", name


def test_pdl_is_asked_for_only_on_cuda():
    assert pdl_launch(torch.device("cpu")) == {"PDL": False}
    assert pdl_launch("cpu") == {"PDL": False}


def test_a_triton_without_grid_dependency_control_runs_the_kernels_without_pdl():
    """Triton before grid dependency control: the kernels import, PDL is never asked for, and a
    kernel (here the RMSNorm, under the interpreter) still computes the reference's result."""
    import os
    import subprocess
    import sys

    code = """
import builtins
real_import = builtins.__import__
def import_without_gdc(name, globals=None, locals=None, fromlist=(), level=0):
    if name == "triton.language.extra.cuda" and "gdc_wait" in (fromlist or ()):
        raise ImportError("this Triton has no grid dependency control")
    return real_import(name, globals, locals, fromlist, level)
builtins.__import__ = import_without_gdc
import torch
from moeferry.kernels.triton import common
from moeferry.kernels.triton.norm_rope import rms_norm
from moeferry.kernels.reference.norm_rope import rms_norm as reference
assert not common._TRITON_HAS_GDC and not common._triton_has_pdl()
x, w = torch.randn(3, 64), torch.rand(64) + 0.5
torch.testing.assert_close(rms_norm(x, w, 1e-6), reference(x, w, 1e-6))
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
