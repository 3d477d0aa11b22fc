"""Qwen2-MoE: qkv bias, and a shared expert whose output is scaled by a sigmoid gate."""

from moeferry.models.registry import FamilySpec

SPEC = FamilySpec(
    model_type="qwen2_moe",
    qk_norm=None,
    qkv_bias=lambda hf: bool(getattr(hf, "qkv_bias", True)),
    renormalize=lambda hf: bool(hf.norm_topk_prob),
    shared_expert=True,
)
