"""What every workload shares: the machine a run measured and its load
(:mod:`~kvnotes_bench.kit.machine`), how a failed request is classified and counted
(:mod:`~kvnotes_bench.kit.failures`) and the number formats of the reports
(:mod:`~kvnotes_bench.kit.formats`). A bundle (JSON, ``report.md``, chart) is written by
:func:`kvnotes.eval.reports.write_bundle`."""
