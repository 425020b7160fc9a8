"""Benchmarks of composition and the erratum on a real vLLM server (``kvnotes serve-bench``)."""
