"""What the tests and the benchmarks share (``moeferry.testing.fixtures``); nothing the engine
itself imports."""
