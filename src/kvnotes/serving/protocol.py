"""kvnotes' wire contract: what the front asks the connector, what the connector did, what the
client is told, as typed, versioned messages.

- :class:`SpliceRequest`: the ranges (and the entry of each) a request asks the connector to
  supply, sent in vLLM's ``kv_transfer_params`` under :data:`PARAMS_KEY`;
- :class:`SpliceReport`: what the connector did for one vLLM request (ranges loaded and from
  which entries, tokens vLLM's prefix cache held, supplied, computed; loads that failed),
  returned by its ``request_finished`` (vLLM puts it in the completion's ``kv_transfer_params``,
  non-streamed answers only);
- :class:`UsageKvnotes`: the ``usage.kvnotes`` object of the front's answer: the plan (its
  :class:`RepairPolicy` as fields), the phases, the guard, the connector's reports;
- :class:`Outcome`: how the front answered a request (its log line, its metrics label).

Each message is a frozen dataclass; ``to_params``/``to_dict`` give its JSON form and
``from_params``/``from_dict`` read one back, refusing (:class:`ProtocolError`) another version,
an unknown field or a malformed value, so neither side acts on what it cannot vouch for. Pure:
no vLLM, no HTTP.

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

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import Repair
from kvnotes.serving.json_types import JsonObject, JsonValue
from kvnotes.serving.library.splice import SpliceRange

# The version of every message here; a reader refuses another one (a front and a connector of
# different kvnotes versions then serve exactly instead of misreading each other).
PROTOCOL_VERSION = 1
# The one key of vLLM's ``kv_transfer_params`` that kvnotes writes and reads, both ways.
PARAMS_KEY = "kvnotes"


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


# ---- reading JSON values strictly -----------------------------------------------------------
def _fields(what: str, value: object, known: Sequence[str], required: Sequence[str] = ()
            ) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(value).__name__}")
    for name in value:
        if name not in known:
            raise ProtocolError(f"{what}: unknown field {name!r} (fields: {', '.join(known)})")
    for name in required:
        if name not in value:
            raise ProtocolError(f"{what}: missing field {name!r}")
    if "v" in known and value.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"{what}: version {value.get('v')!r}; this kvnotes reads version "
                            f"{PROTOCOL_VERSION}")
    return value


def _int(what: str, value: object, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ProtocolError(f"{what}: expected an integer >= {low}, got {value!r}")
    return int(value)


def _float(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not 0.0 <= float(value) <= 1.0:
        raise ProtocolError(f"{what}: expected a number in [0, 1], got {value!r}")
    return float(value)


def _bool(what: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{what}: expected true or false, got {value!r}")
    return value


def _str(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{what}: expected a string, got {value!r}")
    return value


def _list(what: str, value: object) -> list[object]:
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"{what}: expected a list, got {type(value).__name__}")
    return list(value)


def _span(what: str, value: object) -> tuple[int, int]:
    items = _list(what, value)
    if len(items) != 2:
        raise ProtocolError(f"{what}: expected [start, end], got {value!r}")
    start, end = _int(what, items[0]), _int(what, items[1])
    if end < start:
        raise ProtocolError(f"{what}: [start, end] with start <= end, got {value!r}")
    return start, end


def _range(what: str, value: object) -> SpliceRange:
    try:
        return SpliceRange.from_value(value)
    except InvalidArgumentError as err:
        raise ProtocolError(f"{what}: {err}") from None


# ---- front -> connector ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SpliceRequest:
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

    ranges: tuple[SpliceRange, ...] | None
    keys: tuple[str, ...] = ()
    tenant: str | None = None
    tag: str | None = None
    version: int = PROTOCOL_VERSION

    _WHAT = "kvnotes splice request"

    @classmethod
    def leading(cls, tenant: str | None = None, tag: str | None = None) -> SpliceRequest:
        """Splice the prompt's leading run of the entries the connector holds for ``tenant``."""
        return cls(None, (), tenant, tag)

    def __post_init__(self) -> None:
        if self.ranges is None:
            if self.keys:
                raise ProtocolError(f"{self._WHAT}: keys without ranges (keys name the entry "
                                    "of each range)")
            return
        if self.keys and len(self.keys) != len(self.ranges):
            raise ProtocolError(f"{self._WHAT}: {len(self.keys)} keys for {len(self.ranges)} "
                                "ranges (give one entry key per range, or none)")
        for a, b in zip(self.ranges, self.ranges[1:], strict=False):
            if b.piece_start < a.end:
                raise ProtocolError(f"{self._WHAT}: range {b.to_list()} overlaps the one "
                                    f"before it ({a.to_list()})")

    def to_params(self) -> JsonObject:
        """The request's ``kv_transfer_params``."""
        body: JsonObject = {"v": self.version}
        if self.ranges is not None:
            body["ranges"] = [list(r.to_list()) for r in self.ranges]
        if self.keys:
            body["keys"] = list(self.keys)
        if self.tenant is not None:
            body["tenant"] = self.tenant
        if self.tag is not None:
            body["tag"] = self.tag
        return {PARAMS_KEY: body}

    @classmethod
    def from_params(cls, params: object) -> SpliceRequest | None:
        """The message in a request's ``kv_transfer_params`` (None: it carries none);
        :class:`ProtocolError` for one this version does not read."""
        if params is None:
            return None
        if not isinstance(params, Mapping):
            raise ProtocolError(f"kv_transfer_params: expected a JSON object, got "
                                f"{type(params).__name__}")
        if PARAMS_KEY not in params:
            return None
        body = _fields(cls._WHAT, params[PARAMS_KEY], ("v", "ranges", "keys", "tenant", "tag"),
                       ("v",))
        ranges = None if "ranges" not in body else tuple(
            _range(f"{cls._WHAT}: ranges[{i}]", r)
            for i, r in enumerate(_list(f"{cls._WHAT}: ranges", body["ranges"])))
        keys = tuple(_str(f"{cls._WHAT}: keys[{i}]", k)
                     for i, k in enumerate(_list(f"{cls._WHAT}: keys", body.get("keys", []))))
        tenant, tag = (None if body.get(name) is None else _str(f"{cls._WHAT}: {name}", body[name])
                       for name in ("tenant", "tag"))
        return cls(ranges, keys, tenant, tag)


# ---- connector -> front ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LoadedRange:
    """Prompt tokens ``[start, end)`` the connector wrote from entry ``key``, placed at
    ``piece_start`` (the entry's first token's position in the prompt)."""

    piece_start: int
    start: int
    end: int
    key: str

    def __len__(self) -> int:
        return self.end - self.start

    def to_list(self) -> list[JsonValue]:
        return [self.piece_start, self.start, self.end, self.key]

    @classmethod
    def from_value(cls, what: str, value: object) -> LoadedRange:
        items = _list(what, value)
        if len(items) != 4:
            raise ProtocolError(f"{what}: expected [piece_start, start, end, key], got {value!r}")
        r = _range(what, items[:3])
        return cls(r.piece_start, r.start, r.end, _str(what, items[3]))


@dataclass(frozen=True, slots=True)
class SpliceReport:
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
    """

    prompt_tokens: int
    local_hit: int = 0
    loaded: tuple[LoadedRange, ...] = ()
    failed: tuple[tuple[int, int], ...] = ()
    refused: str | None = None
    version: int = PROTOCOL_VERSION

    _WHAT = "kvnotes splice report"

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

    def to_dict(self) -> JsonObject:
        return {"v": self.version, "prompt_tokens": self.prompt_tokens,
                "local_hit": self.local_hit, "loaded": [r.to_list() for r in self.loaded],
                "failed": [list(s) for s in self.failed], "refused": self.refused,
                "entries": list(self.entries), "supplied": self.supplied,
                "computed": self.computed}

    def to_params(self) -> JsonObject:
        """The ``kv_transfer_params`` the connector returns from ``request_finished``."""
        return {PARAMS_KEY: self.to_dict()}

    @classmethod
    def from_dict(cls, value: object) -> SpliceReport:
        """A report from its JSON form; :class:`ProtocolError` for one this version does not
        read (the derived ``entries``, ``supplied``, ``computed`` must agree with the rest)."""
        w = cls._WHAT
        d = _fields(w, value, ("v", "prompt_tokens", "local_hit", "loaded", "failed", "refused",
                               "entries", "supplied", "computed"), ("v", "prompt_tokens"))
        refused = d.get("refused")
        report = cls(
            prompt_tokens=_int(f"{w}: prompt_tokens", d["prompt_tokens"]),
            local_hit=_int(f"{w}: local_hit", d.get("local_hit", 0)),
            loaded=tuple(LoadedRange.from_value(f"{w}: loaded[{i}]", r)
                         for i, r in enumerate(_list(f"{w}: loaded", d.get("loaded", [])))),
            failed=tuple(_span(f"{w}: failed[{i}]", s)
                         for i, s in enumerate(_list(f"{w}: failed", d.get("failed", [])))),
            refused=None if refused is None else _str(f"{w}: refused", refused))
        for name in ("entries", "supplied", "computed"):
            if name in d:
                want = getattr(report, name)
                got = d[name]
                if name == "entries" and isinstance(got, list):
                    got = tuple(got)
                if got != want:
                    raise ProtocolError(f"{w}: {name} is {d[name]!r}, the report's ranges give "
                                        f"{list(want) if name == 'entries' else want!r}")
        return report

    @classmethod
    def from_params(cls, params: object) -> SpliceReport | None:
        """The report in a completion's ``kv_transfer_params`` (None: vLLM returned none)."""
        if not isinstance(params, Mapping) or PARAMS_KEY not in params:
            return None
        return cls.from_dict(params[PARAMS_KEY])


# ---- front -> client ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RepairPolicy:
    """The repair rule a plan ran (:class:`~kvnotes.core.repair.Repair` as a server runs it):
    each spliced piece's first ``max(first, ceil(share * len))`` tokens recomputed in context,
    regions ending on multiples of ``align``; ``skip_exact``: pieces whose notes are already a
    prefill's (the exact chain) are not repaired.

    Example:
        >>> RepairPolicy.of(Repair(first=32, align=16, share=0.1)).to_dict()
        {'first': 32, 'align': 16, 'share': 0.1, 'skip_exact': True}
    """

    first: int
    align: int
    share: float = 0.0
    skip_exact: bool = True

    @classmethod
    def of(cls, repair: Repair) -> RepairPolicy:
        if repair.budget or repair.adapt is not None:
            raise ProtocolError(f"repair {repair.tag()}: a budget or the adaptive rule is not a "
                                "server's repair (first, align, share, skip_exact)")
        return cls(repair.first, repair.align, float(repair.share), repair.skip_exact)

    def repair(self) -> Repair:
        return Repair(first=self.first, align=self.align, share=self.share,
                      skip_exact=self.skip_exact)

    def to_dict(self) -> JsonObject:
        return {"first": self.first, "align": self.align, "share": self.share,
                "skip_exact": self.skip_exact}

    @classmethod
    def from_dict(cls, value: object) -> RepairPolicy:
        w = "kvnotes repair policy"
        d = _fields(w, value, ("first", "align", "share", "skip_exact"), ("first", "align"))
        return cls(_int(f"{w}: first", d["first"]), _int(f"{w}: align", d["align"], 1),
                   _float(f"{w}: share", d.get("share", 0.0)),
                   _bool(f"{w}: skip_exact", d.get("skip_exact", True)))


@dataclass(frozen=True, slots=True)
class PlanEntry:
    """One spliced piece of a plan: its skill ``name``, the entry's ``key``, its prompt tokens
    ``[start, end)`` and how many of them the plan recomputes (0: spliced as it is)."""

    name: str
    key: str
    start: int
    end: int
    repaired: int

    def to_dict(self) -> JsonObject:
        return {"name": self.name, "key": self.key, "start": self.start, "end": self.end,
                "repaired": self.repaired}

    @classmethod
    def from_dict(cls, what: str, value: object) -> PlanEntry:
        d = _fields(what, value, ("name", "key", "start", "end", "repaired"),
                    ("name", "key", "start", "end", "repaired"))
        return cls(_str(f"{what}: name", d["name"]), _str(f"{what}: key", d["key"]),
                   _int(f"{what}: start", d["start"]), _int(f"{what}: end", d["end"]),
                   _int(f"{what}: repaired", d["repaired"]))


@dataclass(frozen=True, slots=True)
class PlanReport:
    """A request's phase plan as the client is told it: the prompt's length, the server's
    block size, the repair, the salt, the ranges asked of the connector, the regions vLLM
    recomputes, the phases' ends, the skills and their entries, the exactly placed skills."""

    prompt_len: int
    block_size: int
    repair: RepairPolicy
    salt: str
    ranges: tuple[SpliceRange, ...]
    regions: tuple[tuple[int, int], ...]
    phase_ends: tuple[int, ...]
    skills: tuple[str, ...] = ()
    entries: tuple[PlanEntry, ...] = ()
    exactly_placed: tuple[str, ...] = ()

    @property
    def spliced_tokens(self) -> int:
        return sum(len(r) for r in self.ranges)

    @property
    def repaired_tokens(self) -> int:
        return sum(b - a for a, b in self.regions)

    def to_dict(self) -> JsonObject:
        return {"prompt_len": self.prompt_len, "block_size": self.block_size,
                "repair": self.repair.to_dict(), "salt": self.salt,
                "ranges": [list(r.to_list()) for r in self.ranges],
                "regions": [list(r) for r in self.regions],
                "phase_ends": list(self.phase_ends), "spliced_tokens": self.spliced_tokens,
                "repaired_tokens": self.repaired_tokens, "skills": list(self.skills),
                "entries": [e.to_dict() for e in self.entries],
                "exactly_placed": list(self.exactly_placed)}

    @classmethod
    def from_dict(cls, value: object) -> PlanReport:
        w = "kvnotes plan"
        d = _fields(w, value, ("prompt_len", "block_size", "repair", "salt", "ranges", "regions",
                               "phase_ends", "spliced_tokens", "repaired_tokens", "skills",
                               "entries", "exactly_placed"),
                    ("prompt_len", "block_size", "repair", "salt", "ranges"))
        plan = cls(
            prompt_len=_int(f"{w}: prompt_len", d["prompt_len"]),
            block_size=_int(f"{w}: block_size", d["block_size"], 1),
            repair=RepairPolicy.from_dict(d["repair"]), salt=_str(f"{w}: salt", d["salt"]),
            ranges=tuple(_range(f"{w}: ranges[{i}]", r)
                         for i, r in enumerate(_list(f"{w}: ranges", d["ranges"]))),
            regions=tuple(_span(f"{w}: regions[{i}]", r)
                          for i, r in enumerate(_list(f"{w}: regions", d.get("regions", [])))),
            phase_ends=tuple(_int(f"{w}: phase_ends", e)
                             for e in _list(f"{w}: phase_ends", d.get("phase_ends", []))),
            skills=tuple(_str(f"{w}: skills", s) for s in _list(f"{w}: skills",
                                                                d.get("skills", []))),
            entries=tuple(PlanEntry.from_dict(f"{w}: entries[{i}]", e)
                          for i, e in enumerate(_list(f"{w}: entries", d.get("entries", [])))),
            exactly_placed=tuple(_str(f"{w}: exactly_placed", s)
                                 for s in _list(f"{w}: exactly_placed",
                                                d.get("exactly_placed", []))))
        for name in ("spliced_tokens", "repaired_tokens"):
            if name in d and d[name] != getattr(plan, name):
                raise ProtocolError(f"{w}: {name} is {d[name]!r}, its ranges and regions give "
                                    f"{getattr(plan, name)}")
        return plan


@dataclass(frozen=True, slots=True)
class UsageKvnotes:
    """The ``usage.kvnotes`` object of the front's answer.

    - ``spliced_tokens``: tokens the plan asks the connector to supply (0: none planned);
    - ``phases``: phase requests sent; ``guard_fired``: the answer is the exact request's;
    - ``plan``: the plan (None: sent exactly); ``exact``: why it was sent exactly (a planning
      reason code), None when it was planned;
    - ``phase_reports``/``report``: what the connector did for each phase (None where vLLM
      returned none) and for the request that answered (None: none returned, e.g. a streamed
      answer, or the guard fired: the answer is the exact request's).
    """

    spliced_tokens: int = 0
    phases: int = 0
    guard_fired: bool = False
    plan: PlanReport | None = None
    exact: str | None = None
    phase_reports: tuple[SpliceReport | None, ...] = ()
    report: SpliceReport | None = None
    version: int = PROTOCOL_VERSION

    _WHAT = "usage.kvnotes"

    def to_dict(self) -> JsonObject:
        return {"v": self.version, "spliced_tokens": self.spliced_tokens, "phases": self.phases,
                "guard_fired": self.guard_fired,
                "plan": None if self.plan is None else self.plan.to_dict(),
                "exact": self.exact,
                "phase_reports": [None if r is None else r.to_dict()
                                  for r in self.phase_reports],
                "report": None if self.report is None else self.report.to_dict()}

    @classmethod
    def from_dict(cls, value: object) -> UsageKvnotes:
        """The client's reading of ``usage.kvnotes``; :class:`ProtocolError` for an object
        this version does not read."""
        w = cls._WHAT
        d = _fields(w, value, ("v", "spliced_tokens", "phases", "guard_fired", "plan", "exact",
                               "phase_reports", "report"), ("v",))
        exact = d.get("exact")
        return cls(
            spliced_tokens=_int(f"{w}: spliced_tokens", d.get("spliced_tokens", 0)),
            phases=_int(f"{w}: phases", d.get("phases", 0)),
            guard_fired=_bool(f"{w}: guard_fired", d.get("guard_fired", False)),
            plan=None if d.get("plan") is None else PlanReport.from_dict(d["plan"]),
            exact=None if exact is None else _str(f"{w}: exact", exact),
            phase_reports=tuple(None if r is None else SpliceReport.from_dict(r)
                                for r in _list(f"{w}: phase_reports",
                                               d.get("phase_reports", []))),
            report=None if d.get("report") is None else SpliceReport.from_dict(d["report"]))

    @property
    def reports(self) -> tuple[SpliceReport, ...]:
        """The connector's reports in the order the requests ran (phases, then the answer's);
        empty when one is missing (the picture would be incomplete)."""
        reports = (*self.phase_reports, self.report)
        return tuple(r for r in reports if r is not None) if None not in reports else ()


@dataclass
class UsageBuilder:
    """A ``usage.kvnotes`` filled in while one request runs (the front's side)."""

    spliced_tokens: int = 0
    plan: PlanReport | None = None
    exact: str | None = None
    guard_fired: bool = False
    phase_reports: list[SpliceReport | None] = field(default_factory=list)
    phases: int = 0
    report: SpliceReport | None = None

    def done(self) -> UsageKvnotes:
        return UsageKvnotes(self.spliced_tokens, self.phases, self.guard_fired, self.plan,
                            self.exact, tuple(self.phase_reports), self.report)
