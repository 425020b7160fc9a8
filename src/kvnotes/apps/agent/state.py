"""The agent state: a customer/reservation record of named fields, and the events changing it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvnotes.core.errors import UnknownFieldError

# field name -> label shown to the model. The record renders in this order: fields that never
# change in an episode first, those that events change last, so a state change invalidates only
# the record's tail (the agent re-prefills from the first changed token on).
FIELDS: dict[str, str] = {
    "customer_name": "Customer name",
    "reservation_id": "Reservation id",
    "email": "Email",
    "passengers": "Passengers",
    "payment_method": "Payment method",
    "departure": "Departure",
    "booked": "Booked",
    "membership": "Membership tier",
    "cabin": "Cabin class",
    "flight_status": "Flight status",
    "insurance": "Travel insurance",
    "checked_bags": "Checked bags",
}


def _check_field(name: str) -> None:
    if name not in FIELDS:
        raise UnknownFieldError(
            f"unknown state field {name!r}; the record has fields: {sorted(FIELDS)}"
        )


@dataclass(frozen=True, slots=True)
class Event:
    """A change to one state field between turns (``note`` says what happened, for reports)."""

    field: str
    value: str
    note: str = ""

    def __post_init__(self) -> None:
        _check_field(self.field)


class State:
    """A record of named fields; :meth:`apply` returns a new state, never mutates this one.

    Example:
        >>> s = State({"insurance": "none", "cabin": "economy"})
        >>> s.apply([Event("insurance", "purchased")])["insurance"]
        'purchased'
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, str]) -> None:
        for name in values:
            _check_field(name)
        self._values: dict[str, str] = {k: str(values[k]) for k in FIELDS if k in values}

    def __getitem__(self, name: str) -> str:
        _check_field(name)
        if name not in self._values:
            raise UnknownFieldError(f"state field {name!r} is not set; set: {sorted(self._values)}")
        return self._values[name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, State) and self._values == other._values

    def __repr__(self) -> str:
        return f"State({self._values!r})"

    def apply(self, events: Iterable[Event]) -> State:
        values = dict(self._values)
        for e in events:
            values[e.field] = e.value
        return State(values)

    def render(self) -> str:
        """The record as the model reads it."""
        lines = [f"- {FIELDS[k]}: {v}" for k, v in self._values.items()]
        return "Customer record:\n" + "\n".join(lines) + "\n"


def label(field: str) -> str:
    """The label of a state field (a clear error for an unknown one)."""
    _check_field(field)
    return FIELDS[field]
