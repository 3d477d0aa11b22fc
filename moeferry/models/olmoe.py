"""OLMoE: q/k RMSNorm over the full projection width, optional qkv clipping."""

from moeferry.models.registry import FamilySpec

SPEC = FamilySpec(
    model_type="olmoe",
    qk_norm="full",
    qkv_bias=lambda hf: False,
    renormalize=lambda hf: bool(hf.norm_topk_prob),
)
