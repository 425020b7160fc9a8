"""Sizes in bytes as people write them: one rule for every option that takes one.

A size is a whole number of bytes (``268435456``), or a number and a unit:

- ``B``: bytes;
- ``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB``: powers of 1000 (SI);
- ``Ki``/``KiB``, ``Mi``/``MiB``, ``Gi``/``GiB``, ``Ti``/``TiB``: powers of 1024 (IEC).

The units are the ones vLLM and Kubernetes read (``64M`` is 64,000,000 bytes, ``64MiB`` is
67,108,864), case aside: ``64mb`` is ``64MB``. A fraction is allowed when it comes to whole
bytes (``1.5GB``, ``0.5KiB``); blanks around the number and unit are ignored.

Example:
    >>> parse_size("64M"), parse_size("64MiB"), parse_size("1.5k"), parse_size(4096)
    (64000000, 67108864, 1500, 4096)
"""

from __future__ import annotations

import re
from decimal import Decimal

from kvnotes.core.errors import InvalidArgumentError

__all__ = ["UNITS", "format_size", "parse_size"]

UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    **{p + s: 1000 ** (i + 1) for i, p in enumerate("KMGT") for s in ("", "B")},
    **{p + s: 1024 ** (i + 1) for i, p in enumerate("KMGT") for s in ("I", "IB")},
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
_EXAMPLES = "e.g. 268435456, 256MiB or 2GB (K/M/G/T: powers of 1000; KiB/MiB/GiB/TiB: of 1024)"


def parse_size(value: str | int, what: str = "size") -> int:
    """Bytes from ``value``: an int, or a string as the module docstring spells it.

    Args:
        value: the size.
        what: the setting it is for, named in the error (e.g. ``--library-cap``).

    Raises:
        InvalidArgumentError: not a size, an unknown unit, a fraction of a byte, or not
            positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgumentError(f"{what} {value!r}: give a number of bytes, {_EXAMPLES}")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.fullmatch(value)
        if m is None:
            raise InvalidArgumentError(f"{what} {value!r} is not a size: give {_EXAMPLES}")
        unit = m.group(2).upper()
        if unit not in UNITS:
            raise InvalidArgumentError(f"{what} {value!r}: unknown unit {m.group(2)!r}; use B, "
                                       "K, M, G, T (powers of 1000) or KiB, MiB, GiB, TiB "
                                       "(powers of 1024)")
        exact = Decimal(m.group(1)) * UNITS[unit]
        if exact != exact.to_integral_value():
            raise InvalidArgumentError(f"{what} {value!r} is {exact} bytes: give a whole "
                                       "number of bytes")
        size = int(exact)
    if size < 1:
        raise InvalidArgumentError(f"{what} {value!r}: give a positive number of bytes")
    return size


def format_size(size: int) -> str:
    """``size`` bytes spelled in the largest unit that holds it whole (what
    :func:`parse_size` reads back to the same bytes).

    Example:
        >>> format_size(67108864), format_size(64_000_000), format_size(1500)
        ('64MiB', '64M', '1500')
    """
    for unit, factor in _LARGEST_FIRST:
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


_LARGEST_FIRST = sorted([(p + "iB", UNITS[p + "IB"]) for p in "KMGT"] + [(p, UNITS[p]) for p in "KMGT"],
                        key=lambda unit: -unit[1])
