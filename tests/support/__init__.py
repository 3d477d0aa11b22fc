"""What the tests and the benchmarks share: tiny checkpoints of every family, the real models'
config.json for dummy loads (``tests.support.fixtures``) and scripted answers
(``tests.support.scripted``). Imported as ``tests.support`` with the repository root on the
path (pytest's ``pythonpath``, or ``python -m benchmarks.NAME`` run from the root); nothing in
the package imports it."""
