"""The agent benchmark: the compose agent against the recompute agent on scripted episodes
(:mod:`~kvnotes.research.agent.run`), its typed summary (:mod:`~kvnotes.research.agent.summary`) and
report (:mod:`~kvnotes.research.agent.report`). The agents themselves are :mod:`kvnotes.apps.agent`."""
