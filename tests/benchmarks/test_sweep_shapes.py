"""The fused-MoE sweeps' layers at any shape: built on the CPU, their sizes read back off the
tensors (the sweeps derive top-k and the expert count from them), and quantized as the sweeps
do (the real shapes' banks are gigabytes: small ones of the same K stand in)."""

from benchmarks.bench_fused_moe import NUM_LAYERS, SHAPES, MoEShape, _make_layers
from benchmarks.sweep_fused_moe import bank_bytes, layer_shape, stored_banks


def test_a_shapes_layers_read_back_as_that_shape():
    shape = MoEShape(hidden=64, inter=32, experts=8, top_k=2)
    layers = _make_layers(3, shape=shape, device="cpu")
    assert len(layers) == NUM_LAYERS and all(layer_shape(layer) == shape for layer in layers)
    hidden, w13, w2, weights, ids, out = layers[0]
    assert hidden.shape == out.shape == (3, 64) and weights.shape == ids.shape == (3, 2) and int(ids.max()) < 8
    assert len(_make_layers(1, shape=shape, device="cpu", count=2)) == 2


def test_gpt_oss_k_quantizes_to_mxfp4_blocks_of_32():
    """gpt-oss's K = 2880 is 90 MXFP4 blocks of 32, 17 bytes each, scales included."""
    assert SHAPES["gpt-oss"].hidden == 2880
    layers = _make_layers(1, shape=MoEShape(hidden=2880, inter=64, experts=2, top_k=1), device="cpu", count=1)
    (w13, w2), = stored_banks(layers, "mxfp4")
    assert bank_bytes(w13) == 2 * 64 * 90 * 17 and bank_bytes(w2) == 2880 * 2 * 17


def test_the_sweeps_read_top_k_off_their_inputs():
    """gemm_inputs' tuples: (hidden, w13, w2, weights, blocks, flat ids, act, route_out, naive)."""
    import torch

    from benchmarks.sweep_fused_moe import inputs_top_k

    inputs = [(torch.zeros(3, 8), None, None, None, None, torch.zeros(12, dtype=torch.int32), None, None, True)]
    assert inputs_top_k(inputs) == 4
