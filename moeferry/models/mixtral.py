"""Mixtral: softmax over the top-k logits (renormalised top-k), w1/w3/w2 expert names."""

from moeferry.models.registry import FamilySpec

SPEC = FamilySpec(
    model_type="mixtral",
    qk_norm=None,
    qkv_bias=lambda hf: False,
    renormalize=lambda hf: True,
    moe_prefix="block_sparse_moe",
    expert_names=("w1", "w3", "w2"),
)
