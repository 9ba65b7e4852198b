"""End-to-end benchmarks: whole models and pipelines, stock and kernelized, eager and compiled."""
