"""The front's guard, by default the served model's calibrated one; ``--guard auto|0|X``.

A :class:`~kvnotes.serving.front.config.FrontConfig` with no ``guard`` (the library's, the
launcher's and ``kvnotes serve --guard auto``'s alike) takes :func:`default_guard` of the served
model: :data:`kvnotes.core.model_defaults.MODEL_DEFAULTS` looked up by its alias, or the last
part of its path. ``--guard 0`` turns the guard off and ``--guard X`` sets tau. A model that is
not in the table is served without a guard (see :mod:`kvnotes.core.model_defaults`).
"""

from __future__ import annotations

import math

from kvnotes.core import model_defaults as defaults_table
from kvnotes.core.errors import InvalidArgumentError

AUTO = "auto"


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
    return default_guard(model)


def default_guard(model: str) -> tuple[float, str]:
    """The calibrated tau of ``model`` (0: off, for a model nobody calibrated), and why (one
    line).

    Example:
        >>> default_guard("qwen2.5-coder-0.5b")[0], default_guard("my-model")[0]
        (0.4, 0.0)
    """
    found = defaults_table.model_defaults(model)
    if found is None:
        why = defaults_table.uncalibrated_reason(model) or (
            f"no calibrated guard for {model} (kvnotes-bench guard --model {model} measures "
            "one)")
        return 0.0, f"off: {why}; --guard X sets it"
    if found.guard == 0:
        return 0.0, f"off for {model}: {found.measured}"
    return found.guard, f"{found.guard:g} for {model}: {found.measured}"
