"""The trace benchmark: field-vs-notes causal patching over the task cases, with bootstrap
confidence intervals (:mod:`~kvnotes.research.trace.suite`; the patch loop is :mod:`kvnotes.ops.trace`)."""
