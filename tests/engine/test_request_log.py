"""One INFO line per finished request, from the engine (so the server and `moeferry generate`
both log it): request id, prompt and output tokens, finish reason, TTFT and decode speed."""

import logging
import re

import pytest

from moeferry import LLM, SamplingParams

LINE = re.compile(r"request (\d+) finished: (\d+) prompt tokens, (\d+) output tokens, finish_reason (\w+), "
                  r"TTFT (\S+)(?: ms)?, decode (\S+)(?: tok/s)?$")


@pytest.fixture(scope="module")
def llm(model_cache):
    return LLM(device="cpu", dtype="float32", max_model_len=64, max_running_requests=4)


def finished_lines(caplog) -> list[tuple]:
    return [LINE.match(r.getMessage()).groups() for r in caplog.records
            if r.name == "moeferry.engine.engine" and r.levelno == logging.INFO and LINE.match(r.getMessage())]


def test_each_finished_request_logs_one_line_with_its_counts_and_timings(llm, caplog):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    with caplog.at_level(logging.INFO, logger="moeferry.engine.engine"):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    lines = finished_lines(caplog)
    assert sorted((n_prompt, n_out, reason) for _, n_prompt, n_out, reason, _, _ in lines) == \
        [("3", "5", "length"), ("5", "5", "length")]
    assert len({rid for rid, *_ in lines}) == 2
    for _, _, _, _, ttft, speed in lines:
        assert float(ttft) > 0 and float(speed) > 0
    assert len(outs) == 2


def test_a_request_aborted_before_its_first_token_logs_no_timings(llm, caplog):
    with caplog.at_level(logging.INFO, logger="moeferry.engine.engine"):
        req = llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
        llm.engine.abort(req)
    assert finished_lines(caplog) == [(str(req.rid), "3", "0", "abort", "-", "-")]


def test_generate_on_the_command_line_logs_the_line(caplog, capsys):
    from moeferry.cli import main

    with caplog.at_level(logging.INFO, logger="moeferry.engine.engine"):
        assert main(["generate", "--device", "cpu", "--dtype", "float32", "--max-model-len", "64", "--prompt",
                     "Hello", "--max-tokens", "3", "--ignore-eos"]) == 0
    assert [line[2:4] for line in finished_lines(caplog)] == [("3", "length")]
