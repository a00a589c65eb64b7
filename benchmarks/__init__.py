"""mok benchmarks: one data-driven harness, ``python -m benchmarks.moe``."""
