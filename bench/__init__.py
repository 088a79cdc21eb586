"""Benchmarks: each prints its figures and writes JSON to bench/results/ (run them with `gyre bench`)."""
