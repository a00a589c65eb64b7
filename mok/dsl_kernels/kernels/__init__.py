"""Whole kernels that run on every architecture (plain CUDA-core code), one kernel class per file:
the routing all-gather, schedule and EP barrier, the epilogues, the backward's finishing
kernels, the MXFP8 quantisers, round trips and dequantiser, the gather, and probes. They are
made of common/'s helpers; ../registry.py lists their variants."""
