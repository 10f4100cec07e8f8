"""Helpers of the benchmark and diagnosis command lines in scripts/ (steady-state decode and
phase timers; the weight-broadcast benchmark). The engine never imports this package."""
