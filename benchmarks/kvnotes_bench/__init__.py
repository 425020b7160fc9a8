"""Measurement, apart from the products: one subpackage per workload, each a config, a run, a
typed result and a report.

- :mod:`~kvnotes.research.edit`: edit strategies against recompute on the task suite;
- :mod:`~kvnotes.research.trace`: field-vs-notes causal patching;
- :mod:`~kvnotes_bench.tools`: tool-choice fidelity on BFCL;
- :mod:`~kvnotes.research.agent`: the compose agent against the recompute agent;
- :mod:`~kvnotes.research.repro`: the paper's claims beside the measurements;
- :mod:`~kvnotes_bench.serving`: the serving workloads on a vLLM server (erratum, skills, soak);
- :mod:`~kvnotes_bench.micro`: timing microbenchmarks (compose TTFT, splice, batched decoding).
"""
