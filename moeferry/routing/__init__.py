"""Routing traces and the expert cache simulator, to size `--moe-cache-gb` before buying memory.

- trace.py: the file format (its docstring), `TraceWriter` (bounded) and `RoutingTrace` (reader).
- recorder.py: `RoutingRecorder`, `--moe-record-routing FILE`: every forward's routes, graphs included.
- profiles.py: generated routing (`uniform`, `qwen3`, `mixtral`) calibrated to published
  statistics, drawn on the device inside a decode graph; the oracle predictor of stated recall.
- forced.py: `ForcedRouting`, a profile's routes forced on a loaded model through its router hooks
  (benchmarks' --routing), with every layer's oracle prediction beside them.
- predict.py: the next-layer predictor (layer l+1's router on an earlier hidden state) and the
  probe that measures its recall on a model's own routing (benchmarks/bench_predictor.py).
- simulate.py: `simulate(trace, num_slots, policy)`, the slot cache's own admission replayed on
  the CPU, and the table `moeferry routing simulate` prints.
"""
