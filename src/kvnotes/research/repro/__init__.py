"""``kvnotes repro``: the paper's claims beside our measurements. The stages
(:mod:`~kvnotes.research.repro.run`), the claims and their verdicts
(:mod:`~kvnotes.research.repro.claims`) and the report (:mod:`~kvnotes.research.repro.report`)."""
