"""kvnotes' wire contract: what the front asks the connector, what the connector did, what the
client is told, as typed, versioned messages.

- :class:`SpliceRequest`: the ranges (and the entry of each) a request asks the connector to
  supply, sent in vLLM's ``kv_transfer_params`` under :data:`PARAMS_KEY`;
- :class:`SaveRequest`: a chunk to compile by the server's own prefill: the token range of a
  request whose KV the connector saves as an entry, under :data:`SAVE_KEY`;
- :class:`SpliceReport`: what the connector did for one vLLM request (ranges loaded and from
  which entries, tokens vLLM's prefix cache held, supplied, computed; loads that failed),
  returned by its ``request_finished`` (vLLM puts it in the completion's ``kv_transfer_params``,
  non-streamed answers only);
- :class:`UsageKvnotes`: the ``usage.kvnotes`` object of the front's answer: the plan's wire
  view (:class:`WirePlan`, its repair as fields), the phases, the guard, the connector's
  reports;
- :class:`Outcome`: how the front answered a request (its log line, its metrics label).

Each message is a frozen pydantic dataclass, validated when built (a malformed one raises
pydantic's ``ValidationError``); ``to_params``/``to_dict`` give its JSON form and
``from_params``/``from_dict`` read one back, refusing (:class:`ProtocolError`, naming the
message and the field) another version, an unknown field or a malformed value (a boolean is
not an integer, a count is not negative), so neither side acts on what it cannot vouch for.
Pure: no vLLM, no HTTP.

Example:
    >>> req = SpliceRequest((SpliceRange(0, 0, 40), SpliceRange(40, 72, 140)), ("a", "b"))
    >>> req.to_params()
    {'kvnotes': {'v': 1, 'ranges': [[0, 0, 40], [40, 72, 140]], 'keys': ['a', 'b']}}
    >>> SpliceRequest.from_params(req.to_params()) == req
    True
    >>> try:
    ...     SpliceRequest.from_params({"kvnotes": {"v": 1, "ranges": [], "extra": 1}})
    ... except ProtocolError as err:
    ...     print(err)
    kvnotes splice request: unknown field 'extra' (fields: v, ranges, keys, tenant, tag)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Self, cast

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PlainSerializer,
    PlainValidator,
    SerializerFunctionWrapHandler,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic.dataclasses import dataclass as message
from pydantic_core import ErrorDetails

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import Repair
from kvnotes.serving.json_types import JsonObject, JsonValue
from kvnotes.serving.library.splice import SpliceRange

# The version of every message here; a reader refuses another one (a front and a connector of
# different kvnotes versions then serve exactly instead of misreading each other).
PROTOCOL_VERSION = 1
# The one key of vLLM's ``kv_transfer_params`` that kvnotes writes and reads, both ways.
PARAMS_KEY = "kvnotes"
# The key of a compile request's save instruction (:class:`SaveRequest`): apart from
# PARAMS_KEY, so a reader of splice requests never meets one.
SAVE_KEY = "kvnotes_save"
_CLOSED = ConfigDict(extra="forbid")  # an unknown field is refused, never dropped
# Why a planned answer's ``usage.kvnotes.report`` is None (its ``no_report``): vLLM puts the
# connector's report in ``kv_transfer_params`` of a non-streamed answer's last engine output
# only, so a stream never has one, nor an answer ended on a stop string (vLLM's frontend
# finds the string and aborts the request: the output that would carry the report is not sent).
NO_REPORT = ("stream", "stop_string", "guard_fired", "refused", "not_returned")


class ProtocolError(InvalidArgumentError):
    """A kvnotes message that is not one this version reads (another version, an unknown
    field, a malformed value); ``str(err)`` names the message and the field."""


class Outcome(StrEnum):
    """How the front answered one request (the values are its log lines' and metrics' labels)."""

    SPLICED = "spliced"
    FORWARDED = "forwarded"
    EXACT = "exact"
    GUARD_FIRED = "guard_fired"
    PHASE_FAILED = "phase_failed"
    UPSTREAM_ERROR = "upstream_error"
    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    REJECTED = "rejected"
    DISCONNECTED = "disconnected"
    INTERNAL_ERROR = "internal_error"


# ---- the values' wire types -----------------------------------------------------------------
Count = Annotated[StrictInt, Field(ge=0)]
Positive = Annotated[StrictInt, Field(ge=1)]
Share = Annotated[float, Strict(), Field(ge=0.0, le=1.0)]  # an integer is a number too


def _ordered(span: tuple[int, int]) -> tuple[int, int]:
    if span[1] < span[0]:
        raise ValueError(f"[start, end] with start <= end, got {list(span)}")
    return span


def _splice_range(value: object) -> SpliceRange:
    return value if isinstance(value, SpliceRange) else SpliceRange.from_value(value)


# token spans ``[start, end]``, and splice ranges as their lists (SpliceRange's own rule)
Span = Annotated[tuple[Count, Count], AfterValidator(_ordered)]
Range = Annotated[SpliceRange, PlainValidator(_splice_range),
                  PlainSerializer(SpliceRange.to_list)]


@dataclasses.dataclass(frozen=True, slots=True)
class LoadedRange:
    """Prompt tokens ``[start, end)`` the connector wrote from entry ``key``, placed at
    ``piece_start`` (the entry's first token's position in the prompt); its JSON form is
    ``[piece_start, start, end, key]``."""

    piece_start: int
    start: int
    end: int
    key: str

    def __len__(self) -> int:
        return self.end - self.start

    def to_list(self) -> list[JsonValue]:
        return [self.piece_start, self.start, self.end, self.key]

    @classmethod
    def from_value(cls, value: object) -> LoadedRange:
        if isinstance(value, LoadedRange):
            return value
        if not isinstance(value, (list, tuple)) or len(value) != 4 \
                or not isinstance(value[3], str):
            raise ValueError(f"expected [piece_start, start, end, key], got {value!r}")
        r = SpliceRange.from_value(value[:3])
        return cls(r.piece_start, r.start, r.end, value[3])


Loaded = Annotated[LoadedRange, PlainValidator(LoadedRange.from_value),
                   PlainSerializer(LoadedRange.to_list, return_type=Any)]


# ---- reading and writing a message ----------------------------------------------------------
_ADAPTERS: dict[type, TypeAdapter[Any]] = {}


def _adapter(cls: type) -> TypeAdapter[Any]:
    """The message's validator and serializer (built on first use: building one is slow)."""
    if cls not in _ADAPTERS:
        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


def _where(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _problem(error: ErrorDetails) -> str:
    """One pydantic error as the field it is about and what is wrong with it."""
    loc, kind, got = error["loc"], error["type"], error.get("input")
    if kind == "missing":
        loc, text = loc[:-1], f"missing field {loc[-1]!r}"
    elif kind == "value_error":  # our own rules (version, fields, ranges): their message
        text = str(error.get("ctx", {}).get("error", error["msg"]))
    elif kind in ("tuple_type", "list_type"):
        text = f"expected a list, got {type(got).__name__}"
    elif kind == "dataclass_type":
        text = f"expected a JSON object, got {type(got).__name__}"
    else:
        text = f"{error['msg'][:1].lower()}{error['msg'][1:]}, got {got!r}"
    return f"{_where(loc)}: {text}" if loc else text


def _json(value: object) -> JsonValue:
    """A derived property's JSON form (they are integers and tuples of strings)."""
    return cast(JsonValue, list(value) if isinstance(value, tuple) else value)


@message(frozen=True, config=_CLOSED)
class _Message:
    """A message's JSON form is ``_WIRE``, in that order: ``v`` the version, the fields, and
    properties derived from them (written for the reader's convenience; on reading, they must
    agree with the fields)."""

    _WHAT: ClassVar[str]
    _WIRE: ClassVar[tuple[str, ...]]

    @model_validator(mode="wrap")
    @classmethod
    def _from_wire(cls, data: object, handler: ModelWrapValidatorHandler[Any]) -> Any:
        if not isinstance(data, Mapping):  # an instance, a constructor's arguments, or refused
            return handler(data)
        unknown = [name for name in data if name not in cls._WIRE]
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r} (fields: {', '.join(cls._WIRE)})")
        if "v" in cls._WIRE and data.get("v") != PROTOCOL_VERSION:
            raise ValueError("missing field 'v'" if "v" not in data else
                             f"version {data['v']!r}; this kvnotes reads version "
                             f"{PROTOCOL_VERSION}")
        own = {f.name for f in dataclasses.fields(cls)}
        msg = handler({name: value for name, value in data.items() if name in own})
        for name in (n for n in cls._WIRE if n in data and n not in own and n != "v"):
            if data[name] != _json(getattr(msg, name)):
                raise ValueError(f"{name} is {data[name]!r}, its other fields give "
                                 f"{_json(getattr(msg, name))!r}")
        return msg

    @model_serializer(mode="wrap", return_type=Any)  # (JsonObject is recursive: no schema)
    def _to_wire(self, handler: SerializerFunctionWrapHandler) -> JsonObject:
        own = handler(self)
        return self._trim({name: own[name] if name in own else
                           PROTOCOL_VERSION if name == "v" else _json(getattr(self, name))
                           for name in self._WIRE})

    def _trim(self, body: JsonObject) -> JsonObject:
        return body

    def to_dict(self) -> JsonObject:
        return cast(JsonObject, _adapter(type(self)).dump_python(self, mode="json"))

    @classmethod
    def from_dict(cls, value: object) -> Self:
        """A message from its JSON form; :class:`ProtocolError` for one this version does not
        read."""
        try:
            return cast(Self, _adapter(cls).validate_python(value))
        except ValidationError as err:
            raise ProtocolError(f"{cls._WHAT}: {_problem(err.errors()[0])}") from None


# ---- front -> connector ---------------------------------------------------------------------
@message(frozen=True, config=_CLOSED)
class SpliceRequest(_Message):
    """The ranges a request asks the connector to supply, in prompt order, and the entry of
    each (``keys``: one per range, or () to let the connector pick by its own rule); the
    ``tenant`` whose entries it may use (None: the shared ones only) and the repair plan's
    ``tag``. ``ranges=None`` (:meth:`leading`) asks for the prompt's leading run of entries the
    connector holds, whatever they are (a client that does not know the library).

    Only a request that carries a splice request is spliced; its ``cache_salt`` must be the one
    ``tenant`` and ``tag`` give (:func:`~kvnotes.serving.library.manifest.splice_salt`): the
    connector composes that salt and compares, it never reads anything out of a salt.

    The connector checks each range against the prompt and its library itself (no client is
    trusted); a message it cannot read is refused whole: the request is served exactly.
    """

    ranges: tuple[Range, ...] | None = None
    keys: tuple[StrictStr, ...] = ()
    tenant: StrictStr | None = None
    tag: StrictStr | None = None

    _WHAT: ClassVar[str] = "kvnotes splice request"
    _WIRE: ClassVar[tuple[str, ...]] = ("v", "ranges", "keys", "tenant", "tag")

    @classmethod
    def leading(cls, tenant: str | None = None, tag: str | None = None) -> SpliceRequest:
        """Splice the prompt's leading run of the entries the connector holds for ``tenant``."""
        return cls(None, (), tenant, tag)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.ranges is None:
            if self.keys:
                raise ValueError("keys without ranges (keys name the entry of each range)")
            return self
        if self.keys and len(self.keys) != len(self.ranges):
            raise ValueError(f"{len(self.keys)} keys for {len(self.ranges)} ranges (give one "
                             "entry key per range, or none)")
        for a, b in zip(self.ranges, self.ranges[1:], strict=False):
            if b.piece_start < a.end:
                raise ValueError(f"range {b.to_list()} overlaps the one before it "
                                 f"({a.to_list()})")
        return self

    def _trim(self, body: JsonObject) -> JsonObject:
        # absent, not null: no ranges asks for the leading run, and [] for none at all
        return {k: v for k, v in body.items() if v is not None and (k != "keys" or v)}

    def to_params(self) -> JsonObject:
        """The request's ``kv_transfer_params``."""
        return {PARAMS_KEY: self.to_dict()}

    @classmethod
    def from_params(cls, params: object) -> SpliceRequest | None:
        """The message in a request's ``kv_transfer_params`` (None: it carries none);
        :class:`ProtocolError` for one this version does not read."""
        if params is None:
            return None
        if not isinstance(params, Mapping):
            raise ProtocolError(f"kv_transfer_params: expected a JSON object, got "
                                f"{type(params).__name__}")
        return None if PARAMS_KEY not in params else cls.from_dict(params[PARAMS_KEY])


_ENTRY_KEY = r"[0-9a-f]{32}"  # an entry's content address (ops.store.skill_key): a file stem
EntryKey = Annotated[StrictStr, Field(pattern=_ENTRY_KEY)]


@message(frozen=True, config=_CLOSED)
class SaveRequest(_Message):
    """Asks the connector to save a request's KV for prompt tokens ``[start, end)`` as the
    entry ``key`` (the chunk's content address, computed by the front), named ``name`` and
    owned by ``tenant`` (None: the operator's, shared): the chunk compiled by the server's own
    prefill, behind the prompt's tokens before ``start`` (its anchor). Sent in
    ``kv_transfer_params`` under :data:`SAVE_KEY`, on a request of its own (``max_tokens`` 1,
    never answered to a client) that carries no splice request: its KV is a prefill's.

    The connector reads the KV from the request's blocks once the forward that computes token
    ``end - 1`` has run (tokens that were prefix-cache hits included) and writes the entry
    whole or not at all; a request aborted or failed before then leaves none.

    Example:
        >>> SaveRequest("0" * 32, 3, 10, "tool-ab12").to_params()["kvnotes_save"]["end"]
        10
    """

    key: EntryKey
    start: Count
    end: Positive
    name: StrictStr = "skill"
    tenant: StrictStr | None = None

    _WHAT: ClassVar[str] = "kvnotes save request"
    _WIRE: ClassVar[tuple[str, ...]] = ("v", "key", "start", "end", "name", "tenant")

    @model_validator(mode="after")
    def _range(self) -> Self:
        if self.end <= self.start:
            raise ValueError(f"[start, end) = [{self.start}, {self.end}) holds no token")
        return self

    def to_params(self) -> JsonObject:
        """The compile request's ``kv_transfer_params``."""
        return {SAVE_KEY: self.to_dict()}

    @classmethod
    def from_params(cls, params: object) -> SaveRequest | None:
        """The save request in ``kv_transfer_params`` (None: it carries none);
        :class:`ProtocolError` for one this version does not read."""
        if not isinstance(params, Mapping) or SAVE_KEY not in params:
            return None
        return cls.from_dict(params[SAVE_KEY])


# ---- connector -> front ---------------------------------------------------------------------
@message(frozen=True, config=_CLOSED)
class SpliceReport(_Message):
    """What the connector did for one vLLM request (every admission of it together).

    - ``prompt_tokens``: the prompt's length;
    - ``local_hit``: tokens vLLM's prefix cache held when the connector was first asked (their
      notes are whatever computed those blocks: this request's earlier phases, or another
      request of the same salt);
    - ``loaded``: the tokens written from entries, per entry, in prompt order;
    - ``failed``: token spans of loads that failed (the entry deleted or damaged since the
      plan): vLLM recomputes from the first failed block on;
    - ``refused``: why the request's :class:`SpliceRequest` was refused (it was then served
      with nothing supplied), None when it was read.

    Its JSON form adds ``entries``, ``supplied`` and ``computed``.
    """

    prompt_tokens: Count
    local_hit: Count = 0
    loaded: tuple[Loaded, ...] = ()
    failed: tuple[Span, ...] = ()
    refused: StrictStr | None = None

    _WHAT: ClassVar[str] = "kvnotes splice report"
    _WIRE: ClassVar[tuple[str, ...]] = ("v", "prompt_tokens", "local_hit", "loaded", "failed",
                                        "refused", "entries", "supplied", "computed")

    @property
    def entries(self) -> tuple[str, ...]:
        """The keys of the entries used, in prompt order, each once."""
        return tuple(dict.fromkeys(r.key for r in self.loaded))

    @property
    def recompute_from(self) -> int | None:
        """The first prompt token vLLM recomputed after a failed load (None: none failed)."""
        return min((a for a, _ in self.failed), default=None)

    @property
    def supplied(self) -> int:
        """Prompt tokens whose notes are the entries' (loaded before any failed load)."""
        cut = self.recompute_from
        return sum(max(0, min(r.end, cut if cut is not None else r.end) - r.start)
                   for r in self.loaded)

    @property
    def computed(self) -> int:
        """Prompt tokens the request computed itself (neither held by the prefix cache nor
        supplied)."""
        return max(0, self.prompt_tokens - self.local_hit - self.supplied)

    def to_params(self) -> JsonObject:
        """The ``kv_transfer_params`` the connector returns from ``request_finished``."""
        return {PARAMS_KEY: self.to_dict()}

    @classmethod
    def from_params(cls, params: object) -> SpliceReport | None:
        """The report in a completion's ``kv_transfer_params`` (None: vLLM returned none)."""
        if not isinstance(params, Mapping) or PARAMS_KEY not in params:
            return None
        return cls.from_dict(params[PARAMS_KEY])


# ---- front -> client ------------------------------------------------------------------------
@message(frozen=True, config=_CLOSED)
class _RepairFields(_Message):
    """The JSON form of a server's :class:`~kvnotes.core.repair.Repair` (the schema
    :func:`repair_from_dict` reads; no one holds one)."""

    first: Count
    align: Positive
    share: Share = 0.0
    skip_exact: StrictBool = True

    _WHAT: ClassVar[str] = "kvnotes repair"
    _WIRE: ClassVar[tuple[str, ...]] = ("first", "align", "share", "skip_exact")


def repair_to_dict(repair: Repair) -> JsonObject:
    """A server's repair as the wire writes it: its first tokens, alignment, share floor and
    ``skip_exact``; a budget or the adaptive rule (engine only) is refused.

    Example:
        >>> repair_to_dict(Repair(first=32, align=16, share=0.1))
        {'first': 32, 'align': 16, 'share': 0.1, 'skip_exact': True}
    """
    if repair.budget or repair.adapt is not None:
        raise ProtocolError(f"repair {repair.tag()}: a budget or the adaptive rule is not a "
                            "server's repair (first, align, share, skip_exact)")
    return {"first": repair.first, "align": repair.align, "share": float(repair.share),
            "skip_exact": repair.skip_exact}


def repair_from_dict(value: object) -> Repair:
    """A server's repair read from its JSON form (:func:`repair_to_dict`'s), strictly:
    :class:`ProtocolError` names the field it cannot read."""
    return _wire_repair(_RepairFields.from_dict(value))


def _wire_repair(value: object) -> Repair:
    """A plan's ``repair`` field: a Repair as it is (a server's only), or read from JSON
    through :class:`_RepairFields`, whose errors keep their field (``plan.repair.share``)."""
    if isinstance(value, Repair):
        repair_to_dict(value)
        return value
    fields = value if isinstance(value, _RepairFields) else \
        _adapter(_RepairFields).validate_python(value)
    return Repair(first=fields.first, align=fields.align, share=fields.share,
                  skip_exact=fields.skip_exact)


# a server's Repair on the wire: its JSON form is repair_to_dict's
WireRepair = Annotated[Repair, PlainValidator(_wire_repair),
                       PlainSerializer(repair_to_dict, return_type=Any)]


@message(frozen=True, config=_CLOSED)
class PlanEntry(_Message):
    """One spliced piece of a plan: its skill ``name``, the entry's ``key``, its prompt tokens
    ``[start, end)`` and how many of them the plan recomputes (0: spliced as it is)."""

    name: StrictStr
    key: StrictStr
    start: Count
    end: Count
    repaired: Count

    _WHAT: ClassVar[str] = "kvnotes plan entry"
    _WIRE: ClassVar[tuple[str, ...]] = ("name", "key", "start", "end", "repaired")


@message(frozen=True, config=_CLOSED)
class WirePlan(_Message):
    """The wire view of a request's plan (``usage.kvnotes.plan``), built only by
    :meth:`PhasePlan.wire <kvnotes.serving.planning.phases.PhasePlan.wire>` and read back by
    clients: the prompt's length, the server's block size, the repair, the salt, the ranges
    asked of the connector, the regions vLLM recomputes, the phases' ends, the skills and
    their entries, the exactly placed skills. It leaves out what only the requests to vLLM
    carry (the tenant, each range's key) and adds what the front matched (skills, entries),
    so a client can read it but not send it. Its JSON form adds ``spliced_tokens`` and
    ``repaired_tokens``."""

    prompt_len: Count
    block_size: Positive
    repair: WireRepair
    salt: StrictStr
    ranges: tuple[Range, ...]
    regions: tuple[Span, ...] = ()
    phase_ends: tuple[Count, ...] = ()
    skills: tuple[StrictStr, ...] = ()
    entries: tuple[PlanEntry, ...] = ()
    exactly_placed: tuple[StrictStr, ...] = ()

    _WHAT: ClassVar[str] = "kvnotes plan"
    _WIRE: ClassVar[tuple[str, ...]] = (
        "prompt_len", "block_size", "repair", "salt", "ranges", "regions", "phase_ends",
        "spliced_tokens", "repaired_tokens", "skills", "entries", "exactly_placed")

    @property
    def spliced_tokens(self) -> int:
        return sum(len(r) for r in self.ranges)

    @property
    def repaired_tokens(self) -> int:
        return sum(b - a for a, b in self.regions)


@message(frozen=True, config=_CLOSED)
class UsageKvnotes(_Message):
    """The ``usage.kvnotes`` object of the front's answer.

    - ``spliced_tokens``: tokens the plan asks the connector to supply (0: none planned);
    - ``phases``: phase requests sent; ``guard_fired``: the answer is the exact request's;
    - ``plan``: the plan (None: sent exactly); ``exact``: why it was sent exactly (a planning
      reason code), None when it was planned;
    - ``phase_reports``/``report``: what the connector did for each phase (None where vLLM
      returned none) and for the request that answered;
    - ``no_report``: why ``report`` is None although the request was planned (one of
      :data:`NO_REPORT`); None when there is a report or nothing was planned.
    """

    spliced_tokens: Count = 0
    phases: Count = 0
    guard_fired: StrictBool = False
    plan: WirePlan | None = None
    exact: StrictStr | None = None
    phase_reports: tuple[SpliceReport | None, ...] = ()
    report: SpliceReport | None = None
    no_report: StrictStr | None = None

    _WHAT: ClassVar[str] = "usage.kvnotes"
    _WIRE: ClassVar[tuple[str, ...]] = ("v", "spliced_tokens", "phases", "guard_fired", "plan",
                                        "exact", "phase_reports", "report", "no_report")

    def _trim(self, body: JsonObject) -> JsonObject:
        # absent when None: an answer with its report reads the same as before the field
        return body if self.no_report is not None else \
            {k: v for k, v in body.items() if k != "no_report"}

    @property
    def reports(self) -> tuple[SpliceReport, ...]:
        """The connector's reports in the order the requests ran (phases, then the answer's);
        empty when one is missing (the picture would be incomplete)."""
        reports = (*self.phase_reports, self.report)
        return tuple(r for r in reports if r is not None) if None not in reports else ()


@dataclasses.dataclass
class UsageBuilder:
    """A ``usage.kvnotes`` filled in while one request runs (the front's side)."""

    spliced_tokens: int = 0
    plan: WirePlan | None = None
    exact: str | None = None
    guard_fired: bool = False
    phase_reports: list[SpliceReport | None] = dataclasses.field(default_factory=list)
    phases: int = 0
    report: SpliceReport | None = None
    no_report: str = "not_returned"  # why report is None, when it is (see NO_REPORT)

    def done(self) -> UsageKvnotes:
        why = None
        if self.report is None and self.plan is not None:
            why = "guard_fired" if self.guard_fired else self.no_report
        return UsageKvnotes(self.spliced_tokens, self.phases, self.guard_fired, self.plan,
                            self.exact, tuple(self.phase_reports), self.report, why)
