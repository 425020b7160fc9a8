"""The skills workload's configuration: its policies, what one run measures
(:class:`SkillsBenchConfig`), a stored run's config read back, the prompt set a config sends."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.serving.planning.phases import check_tau
from kvnotes_bench.serving.prompt_sets import PROMPT_SETS, AirlinePrompts, PromptSet

SKILL_POLICIES = ("cold", "prefix", "compose", "repaired", "guarded", "variants",
                  "variants-guarded")
# the default policies: the variants policies compile extra entries first, so they are asked
# for by name
DEFAULT_POLICIES = ("cold", "prefix", "compose", "repaired", "guarded")
SPLICED_POLICIES = ("compose", "repaired", "guarded", "variants",  # fidelity is measured for
                    "variants-guarded")
PHASED_POLICIES = ("repaired", "guarded", "variants", "variants-guarded")
# the policies whose requests see the declared variants (sent in their tenant, via the front);
# ``variants-guarded`` is what the front does by default when its library holds variants
VARIANTS_POLICIES = ("variants", "variants-guarded")
# each policy the guard runs for (with the run's tau) and the policy it guards: its answer
# whenever the guard does not fire
GUARDED_POLICIES: Mapping[str, str] = {"guarded": "repaired", "variants-guarded": "variants"}
VIAS = ("vllm", "front")
# the phased policies' repair: each skill's first 32 tokens (the engine's default), aligned to
# the server's block size when planned
DEFAULT_REPAIR_TOKENS = 32
# the guard's tau when calibration finds no first token that differs from the exact prompt's
DEFAULT_TAU = 0.5


@dataclass(frozen=True)
class SkillsBenchConfig:
    """What one skills run measures: ``requests`` prompts per (concurrency, policy) row, then
    ``fidelity_samples`` prompts per spliced policy against exact ones. ``prompts`` names the
    prompt set (``k`` skills per airline prompt; ``cases`` BFCL cases within ``max_context``
    tokens), ``via`` where the requests go (vLLM itself, or kvnotes' OpenAI front), ``repair``
    the phased policies' tokens computed in context at the start of each spliced skill."""

    model: str = "smollm2-135m"
    k: int = 4
    requests: int = 16
    concurrency: tuple[int, ...] = (1, 4)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    max_tokens: int = 1  # TTFT phases: the first token is what is measured
    fidelity_samples: int = 20
    fidelity_tokens: int = 16
    seed: int = 0
    warmup: int = 2
    guard_tau: float | None = None  # None: calibrated on ``calibration_samples`` prompts
    calibration_samples: int = 6
    prompts: str = "airline"
    cases: int = 40
    max_context: int = 2048
    via: str = "vllm"
    fidelity_concurrency: tuple[int, ...] = (1,)
    repair: int = DEFAULT_REPAIR_TOKENS
    engine_check: bool = False  # compose the fidelity prompts in kvnotes' engine too

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in SKILL_POLICIES]
        if unknown:
            raise UnknownNameError("policy", unknown[0], SKILL_POLICIES)
        if self.prompts not in PROMPT_SETS:
            raise UnknownNameError("prompt set", self.prompts, PROMPT_SETS)
        if self.via not in VIAS:
            raise UnknownNameError("--via", self.via, VIAS)
        if self.declares_variants and self.via != "front":
            raise InvalidArgumentError("the variants policies go through kvnotes' OpenAI front: "
                                       "give --via front")
        if self.prompts == "airline":
            AirlinePrompts(self.k)  # checks k against the library
        if self.requests < 1:
            raise InvalidArgumentError(f"--requests must be at least 1, got {self.requests}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise InvalidArgumentError("concurrency levels must be at least 1")
        if self.fidelity_samples < 0:
            raise InvalidArgumentError(f"--fidelity-samples must be 0 or more, got "
                                       f"{self.fidelity_samples}")
        if self.guard_tau is not None:
            check_tau(self.guard_tau)
        if self.calibration_samples < 1 and self.calibrates:
            raise InvalidArgumentError("the guarded policies need --guard-tau or at least one "
                                       "calibration sample")
        if not self.fidelity_concurrency or min(self.fidelity_concurrency) < 1:
            raise InvalidArgumentError("--fidelity-concurrency levels must be at least 1")
        if isinstance(self.repair, bool) or not isinstance(self.repair, int) or self.repair < 1:
            raise InvalidArgumentError(f"--repair must be a positive number of tokens, got "
                                       f"{self.repair!r}")
        if self.cases < 1 or self.max_context < 1:
            raise InvalidArgumentError("--cases and --max-context must be at least 1")

    @property
    def declares_variants(self) -> bool:
        """Whether the run declares skill variants: a variants policy is asked for."""
        return any(p in VARIANTS_POLICIES for p in self.policies)

    @property
    def calibrates(self) -> bool:
        """Whether the run chooses the guard's tau itself: a guarded policy is asked for and no
        ``guard_tau`` given."""
        return self.guard_tau is None and any(p in GUARDED_POLICIES for p in self.policies)


def config_from_dict(d: Mapping[str, Any]) -> SkillsBenchConfig:
    """A stored run's :class:`SkillsBenchConfig` (lists back to tuples; a field an older run
    lacks takes its default)."""
    names = {f.name for f in dataclasses.fields(SkillsBenchConfig)}
    options: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                               for k, v in d.items() if k in names}
    return SkillsBenchConfig(**options)


def config_prompt_set(config: SkillsBenchConfig, tokenizer: Any) -> PromptSet:
    """The prompt set a run of ``config`` sends (the same every time for one config)."""
    from kvnotes_bench.serving.prompt_sets import make_prompt_set

    return make_prompt_set(config.prompts, tokenizer, k=config.k, cases=config.cases,
                           max_context=config.max_context, answer_tokens=config.fidelity_tokens)
