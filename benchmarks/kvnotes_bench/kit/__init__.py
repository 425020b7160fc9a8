"""What every workload shares: the machine a run measured and its load
(:mod:`~kvnotes_bench.kit.machine`), how a failed request is classified and counted
(:mod:`~kvnotes_bench.kit.failures`), the one percentile and bootstrap interval
(:mod:`~kvnotes_bench.kit.stats`), the charts (:mod:`~kvnotes_bench.kit.plots`) and the number
formats of the reports (:mod:`~kvnotes_bench.kit.formats`). A bundle (JSON, ``report.md``,
chart) is written by :func:`kvnotes.eval.reports.write_bundle`."""
