"""The routing trace file (routing/trace.py) and its recorder: a written trace reads back as
written, the cap bounds the file with one warning, a file cut mid-step reads its whole steps,
and a file that is not a trace is refused naming what is wrong."""

import logging
import math
import os

import numpy as np
import pytest
import torch

from moeferry.routing.recorder import RoutingRecorder
from moeferry.routing.trace import (MAGIC, RoutingTrace, TraceError, TraceHeader, TraceStep, TraceWriter,
                                    encode_step)

HEADER = TraceHeader(num_moe_layers=3, num_experts=300, top_k=4, expert_bytes=12_345, model="tiny", dtype="float32",
                     strategy="offload", device="cpu", cache_slots=400, cache_policy="layer_lru")


def _steps(seed=0):
    gen = np.random.default_rng(seed)
    shapes = [("prefill", False, 5, 5), ("decode", False, 3, 4), ("prefill", True, 2, 2), ("decode", False, 1, 1)]
    return [TraceStep(phase, demand, tokens, float(i) + 0.25, gen.integers(0, 300, (3, rows, 4)))
            for i, (phase, demand, tokens, rows) in enumerate(shapes)]


def _write(path, steps, header=HEADER, max_bytes=1 << 20):
    writer = TraceWriter(str(path), header, max_bytes)
    written = [writer.write(step) for step in steps]
    writer.close()
    return written


def test_a_written_trace_reads_back_with_the_same_header_steps_and_ids(tmp_path):
    steps = _steps()
    assert _write(tmp_path / "t", steps) == [True] * len(steps)
    trace = RoutingTrace.read(str(tmp_path / "t"))
    assert trace.header == HEADER and not trace.truncated
    assert trace.header.id_dtype == "uint16"  # 300 experts do not fit a byte
    assert len(trace.steps) == len(steps)
    for got, want in zip(trace.steps, steps):
        assert (got.phase, got.demand, got.num_tokens, got.rows, got.step_ms) == \
               (want.phase, want.demand, want.num_tokens, want.rows, want.step_ms)
        assert got.ids.dtype == np.uint16 and np.array_equal(got.ids, want.ids)


def test_ids_of_at_most_256_experts_take_one_byte_each(tmp_path):
    header = TraceHeader(num_moe_layers=2, num_experts=256, top_k=8, expert_bytes=1)
    step = TraceStep("decode", False, 1, math.nan, np.full((2, 1, 8), 255))
    _write(tmp_path / "t", [step], header)
    record = encode_step(header, step)
    assert len(record) == 16 + 2 * 8
    assert os.path.getsize(tmp_path / "t") == len(header.to_bytes()) + len(record)
    got = RoutingTrace.read(str(tmp_path / "t")).steps[0]
    assert got.ids.dtype == np.uint8 and (got.ids == 255).all() and not got.timed


def test_the_cap_bounds_the_file_and_stops_recording_with_one_warning(tmp_path, caplog):
    steps = _steps() * 3
    sizes = [len(encode_step(HEADER, s)) for s in steps]
    cap = len(HEADER.to_bytes()) + sum(sizes[:5]) + sizes[5] // 2
    with caplog.at_level(logging.WARNING):
        written = _write(tmp_path / "t", steps, max_bytes=cap)
    assert written == [True] * 5 + [False] * (len(steps) - 5)
    assert os.path.getsize(tmp_path / "t") <= cap
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "reached its cap" in warnings[0].getMessage()
    assert len(RoutingTrace.read(str(tmp_path / "t")).steps) == 5


def test_the_recorder_drains_each_forward_and_respects_the_cap(tmp_path, caplog):
    header = TraceHeader(num_moe_layers=2, num_experts=8, top_k=2, expert_bytes=1)
    per_step = 16 + 2 * 3 * 2  # a 3-token step: its record's head and 2 layers x 3 rows x 2 ids
    writer = TraceWriter(str(tmp_path / "t"), header, max_bytes=len(header.to_bytes()) + 2 * per_step + 5)
    recorder = RoutingRecorder(writer, max_rows=4, decode_rows=4, device=torch.device("cpu"))
    forwards = [torch.randint(0, 8, (2, 3, 2), dtype=torch.int32, generator=torch.Generator().manual_seed(i))
                for i in range(4)]
    with caplog.at_level(logging.WARNING):
        for ids in forwards:
            with recorder.step(False, 3, demand=lambda: True):
                for layer in range(2):
                    recorder.record(layer, ids[layer])
    trace = RoutingTrace.read(str(tmp_path / "t"))
    assert [s.phase for s in trace.steps] == ["prefill", "prefill"] and all(s.demand for s in trace.steps)
    assert all(np.array_equal(s.ids, f.numpy()) for s, f in zip(trace.steps, forwards))
    assert sum("reached its cap" in r.getMessage() for r in caplog.records) == 1


def test_a_forward_where_a_layer_did_not_record_is_refused(tmp_path):
    header = TraceHeader(num_moe_layers=2, num_experts=8, top_k=2, expert_bytes=1)
    recorder = RoutingRecorder(TraceWriter(str(tmp_path / "t"), header), 4, 4, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"recorded \[2, 0\] routes"):
        with recorder.step(True, 1, demand=lambda: False):
            recorder.record(0, torch.tensor([[1, 2]], dtype=torch.int32))


def test_a_file_cut_inside_a_step_reads_its_whole_steps(tmp_path):
    _write(tmp_path / "t", _steps())
    data = (tmp_path / "t").read_bytes()
    (tmp_path / "cut").write_bytes(data[:-7])
    trace = RoutingTrace.read(str(tmp_path / "cut"))
    assert trace.truncated and len(trace.steps) == len(_steps()) - 1


@pytest.mark.parametrize("content,says", [
    (b"", "magic bytes"),
    (b"not a trace at all", "magic bytes"),
    (MAGIC + b"\x05\x00\x00\x00{oops", "header is not JSON"),
    (MAGIC + b"\x0e\x00\x00\x00{\"version\": 9}", "format version 9"),
])
def test_a_file_that_is_not_a_trace_is_refused_naming_it(tmp_path, content, says):
    (tmp_path / "bad").write_bytes(content)
    with pytest.raises(TraceError, match=says) as err:
        RoutingTrace.read(str(tmp_path / "bad"))
    assert str(tmp_path / "bad") in str(err.value)


def test_a_missing_file_is_refused_naming_it(tmp_path):
    with pytest.raises(TraceError, match="cannot read routing trace .*nope.*No such file"):
        RoutingTrace.read(str(tmp_path / "nope"))


def test_a_step_breaking_the_format_is_refused_before_it_is_written():
    with pytest.raises(ValueError, match="outside"):
        encode_step(HEADER, TraceStep("decode", False, 1, 0.0, np.full((3, 1, 4), 300)))
    with pytest.raises(ValueError, match="want a phase"):
        encode_step(HEADER, TraceStep("decode", False, 1, 0.0, np.zeros((2, 1, 4))))
    with pytest.raises(ValueError, match="live tokens"):
        encode_step(HEADER, TraceStep("decode", False, 2, 0.0, np.zeros((3, 1, 4))))
