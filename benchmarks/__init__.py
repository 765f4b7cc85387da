"""Benchmarks (`make bench`, `make bench-async`); not part of the package."""
