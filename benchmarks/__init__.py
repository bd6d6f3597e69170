"""Benchmarks (not tests): run from the repository root as `python -m benchmarks.NAME`."""
