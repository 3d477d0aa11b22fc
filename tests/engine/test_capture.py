"""engine.cuda_graph.capture's choreography, on the CPU with stand-ins for torch.cuda's
streams and graphs: warm-up calls on a side stream that waits for the current one, the
current stream waiting for the side one, then exactly one call inside the capture (with the
pool passed through), whose result is returned with the graph."""
import contextlib

import torch

from moeferry.engine import cuda_graph


class _Recorder:
    def __init__(self):
        self.events, self.where = [], "current"

    def install(self, monkeypatch):
        recorder = self

        class Stream:
            def __init__(self, name="side"):
                self.name = name

            def wait_stream(self, other):
                recorder.events.append(f"{self.name} waits for {other.name}")

        class Graph:
            pass

        current = Stream("current")

        @contextlib.contextmanager
        def stream(s):
            recorder.where = s.name
            yield
            recorder.where = "current"

        @contextlib.contextmanager
        def graph(g, pool=None):
            recorder.where = f"capture pool={pool}"
            yield
            recorder.where = "current"

        for name, value in (("Stream", Stream), ("current_stream", lambda: current),
                            ("stream", stream), ("CUDAGraph", Graph), ("graph", graph)):
            monkeypatch.setattr(torch.cuda, name, value)
        return Graph

    def call(self):
        self.events.append(f"call on {self.where}")
        return len(self.events)


def test_capture_warms_on_a_side_stream_then_captures_one_call(monkeypatch):
    recorder = _Recorder()
    graph_type = recorder.install(monkeypatch)
    graph, captured = cuda_graph.capture(recorder.call, warmups=2, pool="P")
    assert isinstance(graph, graph_type)
    assert recorder.events == ["side waits for current", "call on side", "call on side",
                               "current waits for side", "call on capture pool=P"]
    assert captured == 5  # what the captured call returned


def test_capture_defaults_to_one_warmup_and_no_pool(monkeypatch):
    recorder = _Recorder()
    recorder.install(monkeypatch)
    cuda_graph.capture(recorder.call)
    assert recorder.events == ["side waits for current", "call on side",
                               "current waits for side", "call on capture pool=None"]
