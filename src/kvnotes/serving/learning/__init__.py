"""Learning on sight: chunks requests carry, compiled in the background once seen often enough.

- :mod:`~kvnotes.serving.learning.sightings`: counting sightings per tenant, deciding when a
  chunk (or a variant of a skill) is due; the counter is an interface (:class:`SightingCounter`).
- :mod:`~kvnotes.serving.learning.compiles`: compiling a due job and the background worker; who
  compiles is an interface too (:class:`CompileLease`).
- :mod:`~kvnotes.serving.learning.learned_bounds`: the learned entries in memory, the leases
  requests hold, and the choice of victims (byte cap, per-tenant quotas, variants per skill, pins).
- :mod:`~kvnotes.serving.learning.learner`: :class:`Learner`, what the front calls.
"""

from kvnotes.serving.learning.compiles import (
    CompileLease,
    Compiler,
    CompileWorker,
    LocalCompileLeases,
    lower_priority,
)
from kvnotes.serving.learning.learned_bounds import Bounds, LearnedIndex, Limits
from kvnotes.serving.learning.learner import Learner, LearnerStats, LearnSettings
from kvnotes.serving.learning.sightings import (
    Job,
    LocalSightings,
    SightingCounter,
    Sightings,
    chunk_id,
    skill_id,
    variant_id,
)

__all__ = [
    "Bounds", "CompileLease", "CompileWorker", "Compiler", "Job", "LearnSettings",
    "LearnedIndex", "Learner", "LearnerStats", "Limits", "LocalCompileLeases",
    "LocalSightings", "SightingCounter", "Sightings", "chunk_id", "lower_priority",
    "skill_id", "variant_id",
]
