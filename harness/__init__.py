"""Benchmark and profiling harness for parallel transformer training."""

__version__ = "0.1.0"
