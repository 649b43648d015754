"""Benchmarks: each script writes JSON under bench/results/; `python -m bench.report` draws the plots."""
