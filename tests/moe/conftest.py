"""Checkpoints shared by the MoE strategy tests: every family's tiny checkpoint, and a tiny
Qwen3-MoE in each quantized expert format."""

import pytest

from tests.support.fixtures import family_configs, make_checkpoint

FAMILIES = family_configs()


@pytest.fixture(scope="module", params=FAMILIES, ids=[n for n, _ in FAMILIES])
def family_ckpt(request, tmp_path_factory):
    """(path, routed experts per layer) of each family's tiny checkpoint."""
    name, config = request.param
    path = str(tmp_path_factory.mktemp(name))
    make_checkpoint(config, path)
    return path, getattr(config, "num_experts", None) or config.num_local_experts


@pytest.fixture(scope="module", params=["fp8", "int4", "mxfp4"])
def quantized_ckpt(request, tmp_path_factory):
    """(path, engine options, experts) of a tiny Qwen3-MoE in each quantized expert format: the
    fp8 and int4 checkpoint layouts (tests/models), mxfp4 by --quantization at load."""
    from tests.support.fixtures import make_fp8_checkpoint, make_int4_checkpoint

    config = dict(FAMILIES)["qwen3_moe"]
    path = str(tmp_path_factory.mktemp(request.param))
    make = {"fp8": lambda: make_fp8_checkpoint(config, path, seed=3, block_shape=(16, 16)),
            "int4": lambda: make_int4_checkpoint(config, path, seed=5, group_size=16),
            "mxfp4": lambda: make_checkpoint(config, path, seed=7)}[request.param]
    make()
    return path, {"quantization": "mxfp4"} if request.param == "mxfp4" else {}, config.num_experts
