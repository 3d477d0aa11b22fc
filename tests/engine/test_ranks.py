"""--tensor-parallel-size on the CPU: two processes over gloo give one process's greedy tokens
and log-probs, each rank holds only its share of the experts, and a rank that dies or raises
ends the run with one clear line instead of a hang."""

import json
import os
import signal
import time

import pytest

from moeferry import LLM, SamplingParams
from moeferry.config import ConfigError, EngineConfig
from moeferry.engine.ranks import RankFailed
from tests.support.fixtures import family_configs, make_checkpoint, make_fp8_checkpoint

FAMILIES = dict(family_configs())
PROMPTS = [[5, 17, 33, 2, 9, 71, 40], [88, 3], [12, 60, 61, 62, 7, 1, 90, 45, 23, 30, 31, 8, 19]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
CPU = dict(dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def make(name, writer=make_checkpoint):
        key = (name, writer.__name__)
        if key not in made:
            made[key] = str(tmp_path_factory.mktemp(name))
            writer(FAMILIES[name], made[key])
        return made[key]
    return make


def _same_generations(one, two):
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one, two):
        for x, y in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in y.top] == [t for t, _ in x.top]
            assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("family,strategy,writer", [
    ("qwen3_moe", "gpu", make_checkpoint),
    ("deepseek_v3", "offload", make_checkpoint),
    ("gpt_oss", "offload", make_checkpoint),
    ("qwen3_moe", "offload", make_fp8_checkpoint),
], ids=["qwen3_moe-gpu", "deepseek_v3-offload", "gpt_oss-offload", "qwen3_moe-fp8-offload"])
def test_two_ranks_generate_one_process_tokens_and_logprobs(checkpoints, family, strategy, writer):
    path = checkpoints(family, writer)
    one = LLM(path, moe_strategy=strategy, **CPU).generate(PROMPTS, GREEDY)
    with LLM(path, moe_strategy=strategy, tensor_parallel_size=2, **CPU) as llm:
        two = llm.generate(PROMPTS, GREEDY)
    _same_generations(one, two)


def _force_routes(engine, profile):
    """Run on every rank: generated routes through router hooks (benchmarks' forced routing)."""
    from moeferry.routing.forced import ForcedRouting
    from moeferry.routing.profiles import get_profile

    ForcedRouting.install(engine, get_profile(profile), seed=3)
    engine.runner.recapture_graphs()


def test_a_call_on_every_rank_changes_every_ranks_engine_alike(checkpoints):
    path = checkpoints("qwen3_moe")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    one = LLM(path, **CPU)
    _force_routes(one.engine, "qwen3")
    with LLM(path, tensor_parallel_size=2, **CPU) as llm:
        llm.engine.run_on_every_rank(_force_routes, "qwen3")
        two = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in two] == [o.token_ids for o in one.generate(PROMPTS, params)]


def _write_held(engine, out_dir):
    """Run on every rank: the rows and bytes of its expert banks, and its slot cache's size."""
    strategy = engine.runner.strategy
    banks = strategy.banks.values()
    held = {"rows": sorted({b.num_experts for b in banks}),
            "bytes": sum(t.numel() * t.element_size() for b in banks for t in b.tensors()),
            "slots": strategy.store.cache.num_slots}
    with open(os.path.join(out_dir, f"rank{strategy.shard.rank}.json"), "w") as f:
        json.dump(held, f)


def test_each_rank_holds_only_its_share_of_the_experts(checkpoints, tmp_path):
    path = checkpoints("qwen3_moe")
    experts = FAMILIES["qwen3_moe"].num_experts
    whole = LLM(path, moe_strategy="offload", **CPU).engine.runner.strategy
    whole_bytes = sum(t.numel() * t.element_size() for b in whole.banks.values() for t in b.tensors())
    with LLM(path, moe_strategy="offload", tensor_parallel_size=2, **CPU) as llm:
        llm.engine.run_on_every_rank(_write_held, str(tmp_path))
        llm.generate([[1, 2]], SamplingParams(max_tokens=1))  # the followers have run the call by this step
    for rank in (0, 1):
        held = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert held["rows"] == [experts // 2]
        assert held["bytes"] * 2 == whole_bytes
        assert held["slots"] == whole.store.cache.num_slots // 2  # every expert of its share, no more


def test_a_killed_rank_ends_the_run_with_one_clear_line(checkpoints):
    llm = LLM(checkpoints("qwen3_moe"), tensor_parallel_size=2, **CPU)
    follower = llm.engine.ranks.followers[0].process
    killed = []

    def kill_once(_out):
        if not killed:
            os.kill(follower.pid, signal.SIGKILL)
            killed.append(time.monotonic())

    with pytest.raises(RankFailed, match=r"^rank 1 of 2 \(pid \d+\) was killed by signal 9: the run cannot go on"):
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), on_output=kill_once)
    assert time.monotonic() - killed[0] < 30
    with pytest.raises(RankFailed, match="stopped after an earlier failure"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    llm.close()
    assert not follower.is_alive()


def _raise_on_followers(engine):
    if engine.runner.strategy.shard.rank != 0:
        raise ValueError("a follower's own trouble")


def test_a_rank_that_raises_ends_the_run_naming_its_error(checkpoints):
    with LLM(checkpoints("qwen3_moe"), tensor_parallel_size=2, **CPU) as llm:
        llm.engine.run_on_every_rank(_raise_on_followers)
        with pytest.raises(RankFailed, match=r"rank 1 of 2 .* raised ValueError: a follower's own trouble"):
            llm.generate([[1, 2]], SamplingParams(max_tokens=2))
        assert all(not f.process.is_alive() for f in llm.engine.ranks.followers)


def test_the_option_is_checked_before_any_rank_starts(checkpoints):
    path = checkpoints("qwen3_moe")  # 8 experts per layer
    with pytest.raises(ConfigError, match=r"^--tensor-parallel-size must be >= 1, got 0$"):
        EngineConfig(tensor_parallel_size=0).check()
    with pytest.raises(ConfigError, match=r"^--tensor-parallel-size 3 splits .* the model has 8: give a size that "
                                          r"divides them$"):
        LLM(path, tensor_parallel_size=3, **CPU)
    with pytest.raises(ConfigError, match=r"^--tensor-parallel-size 2 with --moe-strategy cpu is not built yet"):
        LLM(path, tensor_parallel_size=2, moe_strategy="cpu", **CPU)
