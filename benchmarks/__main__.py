"""``python -m benchmarks``: the benchmarks and what each measures."""

from benchmarks import listing

print(listing())
