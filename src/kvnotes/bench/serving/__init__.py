"""Benchmarks of kvnotes in a vLLM server (``kvnotes serve-bench erratum|skills``).

- :mod:`~kvnotes.bench.serving.kit`: what both workloads share (a measured phase, its summary,
  p90 ratios, the machine and server records, the report formats);
- :mod:`~kvnotes.bench.serving.metrics`: vLLM's ``/metrics`` and summary statistics;
- :mod:`~kvnotes.bench.serving.workload`, :mod:`~kvnotes.bench.serving.erratum`,
  :mod:`~kvnotes.bench.serving.report`: the erratum workload, its runner and its report;
- :mod:`~kvnotes.bench.serving.skills`: the skills workload (composition inside vLLM);
- :mod:`~kvnotes.bench.serving.runs`: either workload against a running server or one started
  by :mod:`kvnotes.serving.launch.launcher`.
"""
