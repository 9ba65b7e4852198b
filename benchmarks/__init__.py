"""Benchmarks and tuning tools, run as modules from the repository root (python -m benchmarks.<kind>.<tool>)."""
