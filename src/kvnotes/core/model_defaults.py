"""Per-model defaults, as calibrated on the development sets: the repair and the guard.

One table for every entry point: :attr:`kvnotes.Engine.defaults` and the front's config
(``FrontConfig.guard`` None, its default: ``FrontConfig.guard_tau``) read :func:`model_defaults`,
so a library user, the launcher, ``kvnotes serve`` (``--guard auto``) and ``kvnotes
serve-bench`` run the same policy, and a benchmark runs the policy a deployment would.

The repair is :data:`~kvnotes.core.repair.DEFAULT_REPAIR` (32 boundary tokens per spliced skill
and at least a tenth of it) for every bundled model: chosen on the small models' development
sets and kept on the Qwen models, where it holds the tool choice on live_multiple
(docs/results/areas/tools.md, "The guard per model"). The guard's ``tau`` is what ``kvnotes
bench guard`` chose on ``live_multiple`` and the airline prompts with that repair (16 greedy
tokens compared with the exact prompt), with what it measured there.

A model that is not in the table gets the default repair and no guard: its first-token margins
were never measured, and a guard that fires on most requests costs an exact prefill each time
(``kvnotes-bench guard --model M`` measures one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath

from kvnotes.core.repair import DEFAULT_REPAIR, Repair


@dataclass(frozen=True, slots=True)
class ModelDefaults:
    """One model's calibrated defaults.

    Attributes:
        guard: the first token's top-2 log-prob margin under which a server answers from the
            exact prompt instead (0: off).
        measured: what the calibration measured, in words (printed by ``kvnotes serve``).
        repair: the boundary repair of spliced skills.
    """

    guard: float
    measured: str
    repair: Repair = field(default=DEFAULT_REPAIR)

    def to_dict(self) -> dict[str, object]:
        return {"guard": self.guard, "measured": self.measured, "repair": self.repair.tag()}


MODEL_DEFAULTS: dict[str, ModelDefaults] = {
    "smollm2-135m": ModelDefaults(0.1, "fired on 2/22 live_multiple requests (9%) and 0/12 "
                                       "airline ones; first tokens identical to exact 19 -> "
                                       "20/22, 16 tokens 12 -> 13/22; spliced tokens recomputed "
                                       "9.3% -> 17.2% on live_multiple"),
    "gemma3-270m": ModelDefaults(0.0, "near-tie first tokens on the airline prompts (median "
                                      "margin 0.49): the smallest tau that fixes a differing "
                                      "first token (0.5) fires on 8/12 requests; 0.1 fires on "
                                      "2/12 and fixes none"),
    "qwen2.5-coder-0.5b": ModelDefaults(0.4, "bfloat16: fired on 0/22 live_multiple requests "
                                             "and 4/24 airline ones (17%); airline first tokens "
                                             "identical to exact 22 -> 24/24, 16 tokens 9 -> "
                                             "13/24; live_multiple unchanged (21/22 first "
                                             "tokens: the one that differs has margin >= 0.75)"),
    "qwen2.5-coder-1.5b": ModelDefaults(0.0, "float32 (the AVX2 host has no BF16): no tau fixes "
                                             "a first token within the 20% fire budget (the "
                                             "first that fixes one fires on 5% of live_multiple "
                                             "at 0.75 and 25% of airline at 0.4); unguarded "
                                             "first tokens identical to exact 20/22 "
                                             "live_multiple, 21/24 airline"),
}

# Bundled models with no calibrated guard yet, and why: served without one.
UNCALIBRATED: dict[str, str] = {}


def _keys(model: str) -> tuple[str, ...]:
    path = PurePath(model)
    return tuple(k.lower() for k in (model, path.name, path.stem))


def model_defaults(model: str) -> ModelDefaults | None:
    """The calibrated defaults of ``model`` (an alias, a folder or a file whose name is the
    alias), None when the table has none.

    Example:
        >>> model_defaults("qwen2.5-coder-0.5b").guard, model_defaults("my-model") is None
        (0.4, True)
    """
    for key in _keys(model):
        found = MODEL_DEFAULTS.get(key)
        if found is not None:
            return found
    return None


def uncalibrated_reason(model: str) -> str | None:
    """Why a bundled model has no calibrated guard, None for any other model."""
    for key in _keys(model):
        if key in UNCALIBRATED:
            return UNCALIBRATED[key]
    return None
