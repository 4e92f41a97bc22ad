"""Benchmarks: `quantzoo bench kernels` and `quantzoo bench model`."""
