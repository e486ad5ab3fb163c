"""Benchmarks: ``python -m codagen bench kernels`` and ``python -m codagen bench block``."""
