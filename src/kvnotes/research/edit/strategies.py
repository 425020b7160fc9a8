"""Strategy specs: a strategy name with its options in one string, e.g. ``repair:attention:32``."""

from __future__ import annotations

from typing import TypedDict

from kvnotes.core.errors import InvalidArgumentError, UnknownNameError

DEFAULT_STRATEGIES: tuple[str, ...] = (
    "recompute", "prefix", "overwrite", "erratum",
    "repair:attention:8", "repair:attention:32", "repair:attention:96",
    "repair:kv_deviation:8", "repair:kv_deviation:32", "repair:kv_deviation:96",
)
ERRATUM_WORDINGS: tuple[str, ...] = ("erratum:update", "erratum:strong", "erratum:restate")


class EditOptions(TypedDict, total=False):
    """A strategy's keyword arguments of :func:`kvnotes.edit`."""

    select: str
    k: int
    template: str


def parse_strategy(spec: str) -> tuple[str, EditOptions]:
    """``"repair:kv_deviation:32"`` -> ``("repair", {"select": "kv_deviation", "k": 32})``;
    ``"erratum:strong"`` -> ``("erratum", {"template": "strong"})``; the options are keyword
    arguments of :func:`kvnotes.edit`."""
    from kvnotes.core.repair import repair_selector, selectors_for
    from kvnotes.ops.edit import ERRATUM_TEMPLATES, STRATEGIES

    name, *rest = spec.split(":")
    if name not in STRATEGIES:
        raise UnknownNameError("strategy", spec, STRATEGIES,
                               "with options: repair:<select>:<k>, erratum:<template>")
    if name == "repair":
        select = repair_selector(rest[0] if rest else "attention", "edit", f"in {spec!r}")
        if len(rest) > 2 or (len(rest) == 2 and not rest[1].isdigit()):
            raise InvalidArgumentError(f"bad repair spec {spec!r}; write "
                                       f"repair:<{'|'.join(selectors_for('edit'))}>:<k>")
        return name, {"select": select, "k": int(rest[1]) if len(rest) == 2 else 32}
    if name == "erratum" and rest:
        if rest[0] not in ERRATUM_TEMPLATES:
            raise UnknownNameError("erratum template", rest[0], sorted(ERRATUM_TEMPLATES))
        return name, {"template": rest[0]}
    if rest:
        raise InvalidArgumentError(f"strategy {name!r} takes no options, got {spec!r}")
    return name, {}
