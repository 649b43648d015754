"""Benchmarks and engine tools (bench/README.md): each writes JSON under bench/results/; `python -m bench.report`
renders the docs' tables from it."""
