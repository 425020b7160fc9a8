"""Measurement: benchmarks of kvnotes' products (serving workloads), apart from the products."""
