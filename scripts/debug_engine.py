"""Device-side debug helper: run the tiny default model through each strategy with and
without CUDA graphs and report the first failure with its traceback."""
import sys
import traceback

from moeferry import LLM, SamplingParams
from moeferry.default_model import ensure_default_model

path = ensure_default_model()
prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(10, 50))]
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
for opts in [dict(disable_cuda_graph=True), dict(), dict(moe_strategy="offload", moe_cache_slots=16)]:
    try:
        out = [o.token_ids for o in LLM(path, max_running_requests=4, **opts).generate(prompts, params)]
        print(opts, "OK", out, flush=True)
    except Exception:
        print(opts, "FAILED", flush=True)
        traceback.print_exc()
        sys.exit(1)
