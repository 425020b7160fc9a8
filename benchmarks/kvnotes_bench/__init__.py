"""Measurement, apart from the products: one subpackage per workload, each a config, a run, a
typed result and a report.

- :mod:`~kvnotes.bench.edit`: edit strategies against recompute on the task suite;
- :mod:`~kvnotes.bench.trace`: field-vs-notes causal patching;
- :mod:`~kvnotes.bench.tools`: tool-choice fidelity on BFCL;
- :mod:`~kvnotes.bench.agent`: the compose agent against the recompute agent;
- :mod:`~kvnotes.bench.repro`: the paper's claims beside the measurements;
- :mod:`~kvnotes.bench.serving`: the serving workloads on a vLLM server (erratum, skills, soak);
- :mod:`~kvnotes.bench.micro`: timing microbenchmarks (compose TTFT, splice, batched decoding).
"""
