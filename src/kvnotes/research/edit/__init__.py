"""Edit evaluation: every strategy on the task suite, measured against recompute of the new value.

For each case the document is prefilled with the old value; each strategy then edits the field
and the question is asked on top. The reference is full recompute of the edited document.

Decisions without chain of thought compare the logits of the answers' first tokens at the
decision position (the position after the question); with ``cot=True`` the model reasons
greedily up to a budget and the answer is parsed from its text (cosine and KL are then read at
the first generated token). A case is *sensitive* when recompute gives different decisions for
the old and the new value; recovery rates count sensitive cases only.

Modules, one job each:

- :mod:`.strategies`: strategy specs (``repair:attention:32``) and the default set;
- :mod:`.cases`: the prompt of a case, and which cases a run takes (spread, shards);
- :mod:`.results`: typed results (row, case, per-strategy summary, the whole run) and aggregation;
- :mod:`.evaluate`: one case, every strategy;
- :mod:`.pool`: the cases in worker processes;
- :mod:`.suite`: a whole run (serial or pooled, resumed, checkpointed);
- :mod:`.checkpoint`: reading an earlier ``results.json`` back to resume from it;
- :mod:`.report`: tables, ``report.md`` and the chart;
- :mod:`.demo`: one case, every strategy, as the edit section of ``kvnotes demo``.
"""
