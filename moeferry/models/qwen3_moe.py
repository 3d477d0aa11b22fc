"""Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k, optional renormalisation."""

from moeferry.models.registry import FamilySpec

SPEC = FamilySpec(
    model_type="qwen3_moe",
    qk_norm="head",
    qkv_bias=lambda hf: bool(getattr(hf, "attention_bias", False)),
    renormalize=lambda hf: bool(hf.norm_topk_prob),
)
