"""Expert formats as objects (moe/formats/): each owns its checkpoint detection, its tensor
names, its storage and its round trip; the loader and the model's name mapping read them."""

import pytest
import torch

from moeferry.kernels.fused_moe.common import dequantize_blocks
from moeferry.moe import formats


@pytest.mark.parametrize("fmt", [formats.fp8_format((16, 16)), formats.int4_format(32), formats.mxfp4_format()],
                         ids=lambda f: f.name)
def test_each_format_dequantizes_what_it_quantized_as_the_kernels_oracle_does(fmt):
    weight = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(0))
    stored, scales = fmt.quantize(weight)
    assert fmt.stores(stored) and stored.shape[-1] == fmt.stored_cols(96)
    ours = fmt.dequantize(stored, scales, 96)
    assert torch.equal(ours, dequantize_blocks(stored, scales, fmt.block_shape, 96))
    assert (ours - weight).abs().max() < weight.abs().max() / 2  # a coarse grid, but the same values
    assert fmt.kernel_args("s13", "s2") == {"w13_scale": "s13", "w2_scale": "s2", "block_shape": fmt.block_shape}


def test_a_checkpoint_names_its_format_by_quant_method():
    class Config:
        def __init__(self, qc):
            self.quantization_config = qc

    fp8 = formats.checkpoint_format(Config({"quant_method": "fp8", "weight_block_size": [64, 128]}))
    assert fp8 == formats.fp8_format((64, 128)) and fp8.describe() == "fp8 e4m3, 64x128 blocks"
    assert formats.checkpoint_format(Config({"quant_method": "mxfp4"})) == formats.mxfp4_format()
    with pytest.raises(formats.ConfigError, match="quant_method 'awq' is not supported"):
        formats.checkpoint_format(Config({"quant_method": "awq"}))
    assert formats.expert_format(None, "int4") == formats.int4_format()
    assert not formats.UNQUANTIZED.quantized and formats.UNQUANTIZED.kernel_args(None, None) == {}


def test_every_formats_tensor_suffixes_reach_the_models_name_mapping():
    from moeferry.models import decoder

    assert {".weight_scale_inv", ".weight_packed", ".weight_scale", ".weight_shape", "_blocks", "_scales"} <= set(
        formats.all_suffixes())
    assert set(formats.all_suffixes()) < set(decoder._TENSOR_PARTS)
    assert formats.is_stored_quantized(torch.zeros(1, dtype=torch.int32))
    assert not formats.is_stored_quantized(torch.zeros(1, dtype=torch.bfloat16))
