"""The front's default guard per model, as calibrated on the development sets.

``kvnotes serve --guard auto`` (its default) looks the served model up in :data:`GUARD_DEFAULTS`
(by its alias, or the last part of its path); ``--guard 0`` turns the guard off and
``--guard X`` sets tau. A model that is not in the table is served without a guard: its
first-token margins were never measured, and a guard that fires on most requests costs an
exact prefill each time (``kvnotes bench guard --model M`` measures one).

Each entry is what ``kvnotes bench guard`` chose on ``live_multiple`` and the airline prompts
(the default repair, 16 greedy tokens compared with the exact prompt; docs/results.md, "The
guard per model"), with what it measured there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import PurePath

from kvnotes.core.errors import InvalidArgumentError

AUTO = "auto"


@dataclass(frozen=True, slots=True)
class GuardDefault:
    """One model's default ``tau`` (0: off) and the measurement behind it, in words."""

    tau: float
    measured: str


GUARD_DEFAULTS: dict[str, GuardDefault] = {
    "smollm2-135m": GuardDefault(0.1, "fired on 2/22 live_multiple requests (9%) and 0/12 "
                                      "airline ones; first tokens identical to exact 19 -> "
                                      "20/22, 16 tokens 12 -> 13/22; spliced tokens recomputed "
                                      "9.3% -> 17.2% on live_multiple"),
    "gemma3-270m": GuardDefault(0.0, "near-tie first tokens on the airline prompts (median "
                                     "margin 0.49): the smallest tau that fixes a differing "
                                     "first token (0.5) fires on 8/12 requests; 0.1 fires on "
                                     "2/12 and fixes none"),
    "qwen2.5-coder-0.5b": GuardDefault(0.4, "bfloat16: fired on 0/22 live_multiple requests "
                                            "and 4/24 airline ones (17%); airline first tokens "
                                            "identical to exact 22 -> 24/24, 16 tokens 9 -> "
                                            "13/24; live_multiple unchanged (21/22 first "
                                            "tokens: the one that differs has margin >= 0.75)"),
}


# Bundled models served without a guard until `kvnotes bench guard` has measured one, and why.
UNCALIBRATED: dict[str, str] = {
    "qwen2.5-coder-1.5b": "not calibrated yet (kvnotes bench guard --model qwen2.5-coder-1.5b "
                          "--dtype bfloat16 --set live_multiple,airline measures it)",
}


def guard_default(model: str) -> GuardDefault | None:
    """The calibrated default of ``model`` (an alias, a folder or a file), None when the table
    has none."""
    for key in (model, PurePath(model).name, PurePath(model).stem):
        found = GUARD_DEFAULTS.get(key.lower())
        if found is not None:
            return found
    return None


def parse_guard(text: str) -> float | None:
    """``--guard``'s value: None for ``auto``, else a log-prob margin >= 0 (0: off).

    Example:
        >>> parse_guard("auto"), parse_guard("0"), parse_guard("0.5")
        (None, 0.0, 0.5)
    """
    value = text.strip().lower()
    if value == AUTO:
        return None
    try:
        tau = float(value)
    except ValueError:
        tau = math.nan
    if not (math.isfinite(tau) and tau >= 0):
        raise InvalidArgumentError(f"--guard {text!r}: give auto (the model's calibrated "
                                   "default), 0 (off) or a log-prob margin such as 0.5")
    return tau


def resolve_guard(text: str, model: str) -> tuple[float, str]:
    """The tau the front runs with for ``--guard text`` on ``model``, and why (one line)."""
    tau = parse_guard(text)
    if tau is not None:
        return tau, f"--guard {tau:g}" if tau else "--guard 0: off"
    found = guard_default(model)
    if found is None:
        why = UNCALIBRATED.get(PurePath(model).name.lower()) or (
            f"no calibrated guard for {model} (kvnotes bench guard --model {model} measures "
            "one)")
        return 0.0, f"off: {why}; --guard X sets it"
    if found.tau == 0:
        return 0.0, f"off for {model}: {found.measured}"
    return found.tau, f"{found.tau:g} for {model}: {found.measured}"
