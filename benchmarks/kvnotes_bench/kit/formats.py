"""The number formats of the reports ("-" for a missing figure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def fmt_s(x: float | None) -> str:
    """Seconds, three decimals ("-" when missing)."""
    return "-" if x is None else f"{x:.3f}s"


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f} ms"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def fmt_kinds(counts: Mapping[str, int]) -> str:
    """``{"timeout": 2, "http_5xx": 1}`` as "http_5xx 1, timeout 2" ("-" when empty)."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


def fmt_load(load: Sequence[float] | None) -> str:
    """The 1-minute load average of a record ("-" when missing)."""
    return "-" if not load else f"{load[0]:.1f}"
