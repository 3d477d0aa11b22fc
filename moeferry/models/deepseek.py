"""DeepSeek-V2/V3: multi-head latent attention (layers/mla.py), dense MLPs in the first
`first_k_dense_replace` layers (ModelConfig.is_moe_layer), ungated shared experts, and the
grouped router (layers/moe.py:GroupedTopKRouter).

V3 routes by sigmoid scores plus `e_score_correction_bias`, its groups scored by their best two
experts (`noaux_tc`); V2 by softmax, greedy or `group_limited_greedy` (a group scored by its best
expert). Both scale the weights by `routed_scaling_factor`; `norm_topk_prob` renormalises the
chosen weights in both, as DeepSeek's own code does (transformers' V2 router ignores it; every
released V2 config sets it false, where the two agree). V2's rope pairs are always
interleaved; V3's unless `rope_interleave` is false. Kimi-K2 is V3 under another model_type
(its config is read with DeepSeek-V3's class: models/registry.py CONFIG_ALIASES).
"""

from moeferry.layers.mla import MLAttention
from moeferry.layers.moe import GroupedTopKRouter
from moeferry.models.registry import FamilySpec


def _router(mc, scoring: str, grouped: bool) -> GroupedTopKRouter:
    hf = mc.hf
    return GroupedTopKRouter(mc.hidden_size, mc.num_experts, mc.top_k, bool(hf.norm_topk_prob), scoring=scoring,
                             num_groups=(hf.n_group or 1) if grouped else 1,
                             topk_groups=(hf.topk_group or 1) if grouped else 1,
                             scaling=float(hf.routed_scaling_factor))


def _spec(model_type: str, router, interleaved) -> FamilySpec:
    return FamilySpec(
        model_type=model_type,
        qk_norm=None,
        qkv_bias=lambda hf: False,
        renormalize=lambda hf: bool(hf.norm_topk_prob),
        attention=lambda mc, layer_id, rotary: MLAttention(mc, layer_id, rotary, interleaved(mc.hf)),
        router=router,
        shared_experts_size=lambda hf: hf.moe_intermediate_size * (hf.n_shared_experts or 0),
    )


def _v3_spec(model_type: str) -> FamilySpec:
    return _spec(model_type, lambda mc: _router(mc, "sigmoid", True),
                 lambda hf: bool(getattr(hf, "rope_interleave", True)))


SPECS = {
    "deepseek_v2": _spec(
        "deepseek_v2",
        lambda mc: _router(mc, "softmax", getattr(mc.hf, "topk_method", "greedy") == "group_limited_greedy"),
        lambda hf: True),
    "deepseek_v3": _v3_spec("deepseek_v3"),
    "kimi_k2": _v3_spec("kimi_k2"),
}
SPEC = SPECS["deepseek_v3"]
