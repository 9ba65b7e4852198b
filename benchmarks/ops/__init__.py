"""Op benchmarks: every op against its peers, and the norm backward alone."""
