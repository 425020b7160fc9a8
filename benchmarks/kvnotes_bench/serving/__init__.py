"""Benchmarks of kvnotes in a vLLM server (``kvnotes serve-bench erratum|skills|soak``).

- :mod:`~kvnotes.bench.serving.kit`: what the workloads share on a server (a measured phase,
  its summary, p90 ratios, the server record; the machine record, failure kinds and formats are
  :mod:`kvnotes.bench.kit`'s);
- :mod:`~kvnotes.bench.serving.metrics`: vLLM's ``/metrics`` and summary statistics;
- :mod:`~kvnotes.bench.serving.client`: the streaming measurement client;
- :mod:`~kvnotes.bench.serving.workload`, :mod:`~kvnotes.bench.serving.erratum`,
  :mod:`~kvnotes.bench.serving.report`: the erratum workload, its runner and its report;
- :mod:`~kvnotes.bench.serving.skills`, :mod:`~kvnotes.bench.serving.skills_report`: the skills
  workload (composition inside vLLM) and its report; its configuration, clients and fidelity
  pass in ``skills_config``, ``skills_clients`` and ``skills_fidelity``;
- :mod:`~kvnotes.bench.serving.soak`, :mod:`~kvnotes.bench.serving.soak_report`: the connector
  under load, every answer checked, and its report; what it sends, its skill events and its
  records in ``soak_workload``, ``soak_events`` and ``soak_result``;
- :mod:`~kvnotes.bench.serving.runs`: either workload against a running server or one started
  by :mod:`kvnotes.serving.launch.launcher`.
"""
