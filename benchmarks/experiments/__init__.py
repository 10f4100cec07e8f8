"""Kernels tried and not adopted, kept with their benchmark (BENCHMARKS.md has the finding):
the engine never imports them."""
