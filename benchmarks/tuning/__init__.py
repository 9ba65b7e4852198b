"""Tuning harnesses: candidate launches beside the package's own, timed in one process."""
