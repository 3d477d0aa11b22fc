"""GPU: a MoE layer's fused entry (residual add + RMSNorm + router linear + top-k in one launch,
kernels/router.add_norm_route) decodes as the four separate ops do: the same greedy tokens and
logits within bf16 rounding of the norm's and the gate's fp32 sums, replay after replay bit for
bit, for `gpu` and `offload`, at the Qwen3-30B-A3B layer shape."""
import os

import pytest
import torch

from benchmarks.common import QWEN3_30B_DIR_CONFIG, write_config_dir
from moeferry.config import EngineConfig
from moeferry.engine.engine import Engine
from moeferry.layers.moe import MoEBlock
from moeferry.sampling import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy", ["gpu", "offload"])
def test_decode_with_the_fused_entry_matches_the_separate_ops(strategy, tmp_path, monkeypatch):
    cfg = write_config_dir(os.path.join(tmp_path, "m"), QWEN3_30B_DIR_CONFIG)
    engine = Engine(EngineConfig(model=cfg, load_format="dummy", hf_overrides={"num_hidden_layers": 4},
                                 moe_strategy=strategy, max_running_requests=4, max_model_len=256,
                                 num_tokens=4096))
    for i in range(3):
        engine.add_request(list(range(1 + i, 40 + 7 * i)),
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    reqs, runner = list(engine.scheduler.running), engine.runner
    assert len(reqs) == 3 and runner.graphs is not None
    calls = []
    fuses = MoEBlock._fuses_entry
    monkeypatch.setattr(MoEBlock, "_fuses_entry", lambda self, x: calls.append(fuses(self, x)) or calls[-1])
    runner.recapture_graphs()
    assert calls and all(calls), "3 decode rows at this shape take the fused entry"
    fused = [runner.run_decode(reqs).clone() for _ in range(3)]
    monkeypatch.setattr(MoEBlock, "_fuses_entry", lambda self, x: False)
    runner.recapture_graphs()
    separate = runner.run_decode(reqs).clone()
    torch.cuda.synchronize()
    for again in fused[1:]:
        assert torch.equal(again, fused[0])
    assert separate.abs().max() > 0
    assert torch.equal(fused[0].argmax(-1), separate.argmax(-1))
    assert (fused[0] - separate).abs().mean() < 1e-2 * separate.abs().mean()
