"""``kvnotes repro``: the paper's claims beside our measurements. The stages
(:mod:`~kvnotes.bench.repro.run`), the claims and their verdicts
(:mod:`~kvnotes.bench.repro.claims`) and the report (:mod:`~kvnotes.bench.repro.report`)."""
