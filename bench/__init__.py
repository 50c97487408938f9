"""Benchmarks: one script per comparison, each printing a table (python -m bench.<name>)."""
