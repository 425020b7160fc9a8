"""Benchmarks of kvnotes in a vLLM server (``kvnotes-bench serve erratum|skills|soak``).

- :mod:`~kvnotes_bench.serving.kit`: what the workloads share on a server (a measured phase,
  its summary, p90 ratios, the server record; the machine record, failure kinds and formats are
  :mod:`kvnotes_bench.kit`'s);
- :mod:`~kvnotes_bench.serving.metrics`: vLLM's ``/metrics`` (percentiles are
  :mod:`kvnotes_bench.kit.stats`');
- :mod:`~kvnotes_bench.serving.client`: the one HTTP client every workload sends through
  (``openai.AsyncOpenAI``, streamed and timed);
- :mod:`~kvnotes_bench.serving.workload`, :mod:`~kvnotes_bench.serving.erratum`,
  :mod:`~kvnotes_bench.serving.report`: the erratum workload, its runner and its report;
- :mod:`~kvnotes_bench.serving.skills`, :mod:`~kvnotes_bench.serving.skills_report`: the skills
  workload (composition inside vLLM) and its report; its configuration, clients and fidelity
  pass in ``skills_config``, ``skills_clients`` and ``skills_fidelity``;
- :mod:`~kvnotes_bench.serving.soak`, :mod:`~kvnotes_bench.serving.soak_report`: the connector
  under load, every answer checked, and its report; what it sends, its skill events and its
  records in ``soak_workload``, ``soak_events`` and ``soak_result``;
- :mod:`~kvnotes_bench.serving.runs`: either workload against a running server or one started
  by :mod:`kvnotes.serving.launch.launcher`.
"""
