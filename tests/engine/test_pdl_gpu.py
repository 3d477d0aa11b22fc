"""GPU: programmatic dependent launch changes when a kernel starts, never what it computes. The
decode graph's logits with PDL equal those without it, bit for bit and replay after replay, for
`gpu` and for `offload`, at the Qwen3-30B-A3B layer shape."""
import os

import pytest
import torch

from tests.support.fixtures import QWEN3_30B_DIR_CONFIG, write_config_dir
from moeferry.config import EngineConfig
from moeferry.engine.engine import Engine
from moeferry.kernels import triton_common as common
from moeferry.sampling import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy", ["gpu", "offload"])
def test_decode_logits_with_pdl_equal_those_without(strategy, tmp_path, monkeypatch):
    assert common._gpu_has_pdl(torch.cuda.current_device()), "the GPU tests run on a Hopper GPU"
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
    logits = {}
    for pdl in (False, True):
        monkeypatch.setattr(common, "_pdl_enabled", pdl)
        runner.recapture_graphs()
        logits[pdl] = [runner.run_decode(reqs).clone() for _ in range(3)]
    torch.cuda.synchronize()
    assert logits[False][0].abs().max() > 0
    for got in logits[False][1:] + logits[True]:
        assert torch.equal(got, logits[False][0])
