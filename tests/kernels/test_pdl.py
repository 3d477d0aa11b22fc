"""Every Triton kernel of the engine may be launched with programmatic dependent launch
(kernels/triton/common.py): each takes PDL and calls wait_for_previous_kernel(PDL) before any
other statement, so that no kernel touches memory before the one before it has finished; and
pdl_launch asks for PDL only on a CUDA device. (PDL on the GPU: tests/engine/test_pdl_gpu.py.)"""
import ast
import pathlib

import torch

import moeferry.kernels.triton as triton_kernels
from moeferry.kernels.triton.common import pdl_launch


def _jit_kernels():
    for path in sorted(pathlib.Path(triton_kernels.__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            jitted = isinstance(node, ast.FunctionDef) and any("triton.jit" in ast.unparse(d)
                                                               for d in node.decorator_list)
            if jitted and node.name.startswith("_") and node.name.endswith("_kernel"):
                yield f"{path.name}:{node.name}", node


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
