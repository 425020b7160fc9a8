"""A result record's JSON form, written once for every flat dataclass the workloads keep."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any, Self, cast


class Record:
    """Mixed into a dataclass: :meth:`to_dict` is ``asdict``, :meth:`from_dict` reads it back.

    A key the record does not know is ignored and a field the dict lacks takes its default, so
    a bundle written by an older or newer version of a workload still reads.

        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Row(Record):
        ...     n: int
        ...     label: str = "-"
        >>> Row.from_dict({"n": 3, "gone": 1}), Row(2).to_dict()
        (Row(n=3, label='-'), {'n': 2, 'label': '-'})
    """

    def to_dict(self) -> dict[str, Any]:
        return asdict(cast(Any, self))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        return cls(**{f.name: d[f.name] for f in fields(cast(Any, cls)) if f.name in d})
