"""The quantized formats at the real Qwen3-30B-A3B expert shape on a GPU: 12 layers with dummy
weights quantized at load, `gpu` against `offload` in a fixed --moe-cache-gb. Called by the
fp8, int4 and MXFP4 checkpoint tests, each asserting its own bytes per expert and slots."""
from moeferry import LLM, SamplingParams


def offload_decodes_gpus_tokens(tmp_path, quantization: str, cache_gb: float):
    """--quantization `quantization` --load-format dummy: offload within `cache_gb` GiB of slots
    decodes `gpu`'s greedy tokens. Returns (bytes per expert, offload's memory plan)."""
    from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir

    path = write_config_dir(str(tmp_path / "qwen3"), QWEN3_30B_DIR_CONFIG)
    common = dict(load_format="dummy", quantization=quantization, hf_overrides={"num_hidden_layers": 12},
                  dtype="bfloat16", device="cuda", max_running_requests=4, num_tokens=4096, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 17, 33, 2], [88, 3, 9]]
    gpu = LLM(path, **common)
    expert_bytes = gpu.engine.runner.strategy.expert_bytes
    want = [o.token_ids for o in gpu.generate(prompts, params)]
    del gpu
    offload = LLM(path, moe_strategy="offload", moe_cache_gb=cache_gb, **common)
    assert [o.token_ids for o in offload.generate(prompts, params)] == want
    return expert_bytes, offload.engine.runner.plan
