"""Routing traces, to size `--moe-cache-gb` before buying memory.

- trace.py: the file format (its docstring), `TraceWriter` (bounded) and `RoutingTrace` (reader).
- recorder.py: `RoutingRecorder`, `--moe-record-routing FILE`: every forward's routes, graphs included.
"""
