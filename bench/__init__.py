"""Benchmark scripts; each row of BENCHMARKS.md names the command here that repeats it."""
