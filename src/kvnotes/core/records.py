"""The JSON edge of the typed results: pydantic reads and writes them.

Result types are frozen pydantic dataclasses (positional construction, ``dataclasses.replace``
and validation on read); :class:`JsonRecord` gives each the two names its callers use, so no
type writes its own field-by-field conversion.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Self

from pydantic import BeforeValidator, JsonValue, PlainSerializer, TypeAdapter

Json = dict[str, JsonValue]


def _nan_for_null(value: object) -> object:
    return math.nan if value is None else value


def _null_for_nonfinite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# a float that JSON holds as null when not finite (strict JSON has no NaN)
NullableFloat = Annotated[float, BeforeValidator(_nan_for_null),
                          PlainSerializer(_null_for_nonfinite)]


_ADAPTERS: dict[object, TypeAdapter[Any]] = {}


def adapter(cls: Any) -> TypeAdapter[Any]:
    """One cached adapter per type (building one compiles its schema)."""
    if cls not in _ADAPTERS:
        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


def checked(data: object) -> JsonValue:
    """``data`` checked to be JSON (a value written by a type that is not a record)."""
    out: JsonValue = adapter(JsonValue).validate_python(data)
    return out


class JsonRecord:
    """``to_dict()`` / ``from_dict()`` for a pydantic dataclass, through pydantic."""

    __slots__ = ()

    def to_dict(self) -> Json:
        """The JSON object (NaN stays a float: ``json.dumps`` writes it as before)."""
        out: Json = adapter(type(self)).dump_python(self, mode="json", by_alias=True)
        return out

    @classmethod
    def from_dict(cls, data: object) -> Self:
        """Read back :meth:`to_dict` (unknown keys ignored, types checked)."""
        out: Self = adapter(cls).validate_python(data)
        return out
