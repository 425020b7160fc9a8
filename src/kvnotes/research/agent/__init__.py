"""The agent benchmark: the compose agent against the recompute agent on scripted episodes
(:mod:`~kvnotes.bench.agent.run`), its typed summary (:mod:`~kvnotes.bench.agent.summary`) and
report (:mod:`~kvnotes.bench.agent.report`). The agents themselves are :mod:`kvnotes.apps.agent`."""
