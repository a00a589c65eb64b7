"""Kernels and device helpers shared by every architecture (plain CUDA-core code)."""
