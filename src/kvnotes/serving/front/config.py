"""The front's settings (:class:`FrontConfig`, every limit a named field) and its keys.

Keys: with ``api_key`` or ``key_file`` set, every ``/v1`` and ``/kvnotes`` request needs
``Authorization: Bearer <key>`` (401 otherwise). The key file maps keys to tenants::

    {"keys": {"sk-acme-1": {"tenant": "acme"}, "sk-globex": {"tenant": "globex"},
              "sk-ops": {}}}

A request's tenant (its splice salt) is then its key's: ``api_key``'s is ``tenant``, a key with
no tenant is in the shared one. :class:`Keys` looks a presented key up.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    ValidationInfo,
)
from pydantic.dataclasses import dataclass

from kvnotes.core.errors import InvalidArgumentError, KvnotesError
from kvnotes.core.repair import SERVER_REPAIR, Repair, parse_repair, repair_spelling
from kvnotes.core.sizes import format_size, parse_size
from kvnotes.serving.front.guard_defaults import default_guard
from kvnotes.serving.library.manifest import splice_salt
from kvnotes.serving.planning.part_tokens import DEFAULT_CHARS as PART_CACHE_CHARS
from kvnotes.serving.planning.phases import check_tau
from kvnotes.serving.vllm_endpoints import check_loopback_url

DEFAULT_MIRROR_BYTES = 8 << 30  # a host's copies of a shared store's entries
API_KEY_ENV = "KVNOTES_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"


# Linux CFS load weights by nice value (kernel/sched/core.c, sched_prio_to_weight): a runnable
# thread's CPU share on a contended core is its weight over the sum of the weights there.
_CFS_WEIGHT = (1024, 820, 655, 526, 423, 335, 272, 215, 172, 137,
               110, 87, 70, 56, 45, 36, 29, 23, 18, 15)


# a compile's nice value: 3.4% of a saturated core (busy_core_share), all of an idle one
DEFAULT_COMPILE_NICE = 15
# vLLM's KV block for a learning server: repair regions are rounded up to blocks, and agent
# traffic's chunks are short, so at the CPU build's default 128 rounding costs 14-16 points of
# the spliced share (docs/results.md, agent traffic)
LEARN_BLOCK_SIZE = 32


def busy_core_share(nice: int) -> float:
    """The share of a core a thread at ``nice`` gets beside one busy thread at nice 0 (Linux's
    scheduler weights): the CPU a background compile takes from, and is guaranteed by, a
    saturated server.

    Example:
        >>> round(busy_core_share(15), 3), busy_core_share(0)
        (0.034, 0.5)
    """
    if not 0 <= nice <= 19:
        raise InvalidArgumentError(f"nice {nice!r}: use 0 to 19")
    weight = _CFS_WEIGHT[nice]
    return weight / (_CFS_WEIGHT[0] + weight)


# ---- how a setting is checked ------------------------------------------------------------------
# One constraint per kind of setting: pydantic checks it when a config is built (and again on
# dataclasses.replace), and a serve config file's sections reuse the same fields.
Count = Annotated[int, Field(strict=True, ge=1)]  # strict: True is not a count, nor "2"
Seconds = Annotated[float, Field(gt=0)]


def _setting(info: ValidationInfo) -> str:
    """The setting a validator checks, as its error names it: ``FrontConfig.api_key``, or a
    serve config file's ``auth.api_key`` (the section's model is titled by its key)."""
    return f"{info.config.get('title') if info.config else ''}.{info.field_name}".lstrip(".")


def _size(value: object, info: ValidationInfo) -> object:
    """A size setting's bytes: an int, or a string such as ``256MiB`` (:func:`parse_size`)."""
    if value is None:
        return value
    return parse_size(value, _setting(info))  # type: ignore[arg-type]  # it refuses the rest


def _key(value: str | None, info: ValidationInfo) -> str | None:
    return None if value is None else check_key(value, _setting(info))


def _tenant(value: str | None) -> str | None:
    splice_salt(value)  # the tenant's spelling rule
    return value


def _tau(value: float | None) -> float | None:
    return None if value is None else check_tau(value)


def front_repair(value: object) -> Repair:
    """The repair a server runs, from a :class:`Repair` or its spelling (``K``, ``K@F``:
    :func:`~kvnotes.core.repair.parse_repair`). A shared budget or the adaptive rule (``~T``)
    is refused: both need the engine, and a server plans its phases before the request runs.

    Example:
        >>> front_repair("32@0.1") == Repair(first=32, share=0.1), front_repair(8).first
        (True, 8)
    """
    repair = value if isinstance(value, Repair) else parse_repair(value)  # type: ignore[arg-type]
    if repair.adapt is not None:
        raise InvalidArgumentError(
            f"repair {repair_spelling(repair)}: the adaptive rule (~T) runs in the engine only "
            "(it sizes each region from the notes it recomputed, which the server's phases "
            "never read back); give K or K@F, e.g. 32@0.1")
    if repair.budget:
        raise InvalidArgumentError(
            f"Repair(budget={repair.budget!r}): a shared budget runs in the engine only; a "
            "server repairs each skill's first tokens: give K or K@F, e.g. 32@0.1")
    return repair


def _loopback(value: str | None) -> str | None:
    if value is not None:
        check_loopback_url(value)
    return value


Size = Annotated[int, Field(strict=True, ge=1), BeforeValidator(_size)]
OptionalSize = Annotated[int | None, Field(strict=True, ge=1), BeforeValidator(_size)]
Key = Annotated[str | None, AfterValidator(_key)]
_CONFIG = ConfigDict(extra="forbid")


def invalid_setting(err: ValidationError, owner: str) -> KvnotesError:
    """``err`` as kvnotes' error, each failed setting named (``owner.name``) with what it needs.
    An error one of the checks raised itself is a :class:`KvnotesError` whose message already
    names the setting: alone, it is returned as it is (its class kept).

    Example:
        >>> try:
        ...     LearnConfig(after=0)
        ... except InvalidArgumentError as e:
        ...     print(e)
        LearnConfig.after: Input should be greater than or equal to 1 (got 0)
    """
    errors = err.errors()
    parts: list[str] = []
    for e in errors:
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, KvnotesError):
            if len(errors) == 1:
                return cause
            parts.append(str(cause))
            continue
        where = ".".join(str(p) for p in e["loc"])
        got = "" if e["type"] in _NO_INPUT else f" (got {e['input']!r})"
        parts.append(f"{owner}.{where}: {e['msg']}{got}" if where else f"{owner}: {e['msg']}")
    return InvalidArgumentError("; ".join(parts))


# error types whose input is the whole set of arguments, not the setting's value
_NO_INPUT = frozenset({"missing", "extra_forbidden", "unexpected_keyword_argument",
                       "missing_argument", "multiple_argument_values"})
_T = TypeVar("_T")


def _raising_kvnotes_errors(cls: type[_T]) -> type[_T]:
    """``cls`` whose construction raises :func:`invalid_setting`'s error instead of pydantic's
    ``ValidationError`` (callers catch kvnotes' family, ``InvalidArgumentError``)."""
    init = cls.__init__

    @functools.wraps(init)
    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except ValidationError as err:
            raise invalid_setting(err, cls.__name__) from None

    cls.__init__ = checked_init  # type: ignore[method-assign]
    return cls


@_raising_kvnotes_errors
@dataclass(frozen=True, slots=True, config=_CONFIG)
class LearnConfig:
    """How the front learns the chunks it sees (:mod:`kvnotes.serving.learning`): each field's
    description says what it does (``kvnotes serve``'s config file, ``[learning]``, reads the
    same fields)."""

    after: Annotated[Count, Field(description=(
        "The sighting (per tenant) at which a chunk is compiled, in the background"))] = 2
    min_tokens: Annotated[Count, Field(description=(
        "Chunks shorter than this many tokens are never learned"))] = 32
    library_cap: Annotated[OptionalSize, Field(description=(
        "Bytes of learned entries the serving folder may hold (e.g. 256MiB, 1GB: K/M/G are "
        "powers of 1000, KiB/MiB/GiB of 1024); least recently used evicted beyond it (never "
        "the operator's registered skills, pinned entries, or entries a running request was "
        "planned with). None: no cap"))] = None
    tenant_quota: Annotated[OptionalSize, Field(description=(
        "Bytes of learned entries one tenant may hold (the shared tenant included). None: no "
        "quota"))] = None
    max_tracked: Annotated[Count, Field(description=(
        "Chunks whose sightings are counted in memory (least recently seen forgotten beyond "
        "it)"))] = 100_000
    queue_size: Annotated[Count, Field(description=(
        "Compile jobs waiting for the worker (a job beyond it is dropped, counted, and queued "
        "again at a later sighting)"))] = 64
    flush_s: Annotated[Seconds, Field(description=(
        "How often, at most, hit counts are written to the registry (seconds)"))] = 5.0
    max_variants: Annotated[Count, Field(description=(
        "Learned entries kept per skill (the skill compiled behind each predecessor seen "
        "`after` times before it, and the chunk learned itself); the least recently used "
        "beyond it is evicted (pinned and leased ones are kept)"))] = 4
    compile_nice: Annotated[int, Field(strict=True, ge=0, le=19, description=(
        "Nice value of the compile thread. On an idle CPU a compile runs at full speed at "
        "any value; on a core a serving thread keeps busy, the kernel gives it a share fixed "
        "by this value (15: 3.4%, 19: 1.4%, 0: half), so it costs concurrent requests at most "
        "about that share and still finishes (docs/results/areas/learning.md)"))] = (
        DEFAULT_COMPILE_NICE)
    block_size: Annotated[Count, Field(description=(
        "vLLM's KV block size for a server launched to learn when no block size is given "
        "(short chunks lose less of their spliced share to rounding at small blocks)"))] = (
        LEARN_BLOCK_SIZE)


@_raising_kvnotes_errors
@dataclass(frozen=True, slots=True, config=_CONFIG)
class FrontConfig:
    """How the front runs: each field's description says what it does (``kvnotes serve``'s
    config file reads the same fields, by section). A request's ``kvnotes.repair`` and
    ``kvnotes.guard`` override ``repair`` and ``guard`` for that request."""

    upstream: Annotated[str | None, AfterValidator(_loopback), Field(description=(
        "The vLLM server's URL (loopback only; None in a LaunchConfig, whose launcher fills in "
        "the server it starts)"))] = None
    port: Annotated[int | None, Field(description="The front's port (None: a free one)")] = None
    host: Annotated[str, Field(description=(
        "The address the front listens on (0.0.0.0: every interface; set a key then)"))] = (
        "127.0.0.1")
    repair: Annotated[Repair, PlainValidator(front_repair), Field(description=(
        "What each spliced skill recomputes in context: a Repair or its spelling, K its first "
        "K tokens (0: a bare splice), K@F at least the share F of it (e.g. 32@0.1), rounded "
        "up to the block"))] = SERVER_REPAIR
    guard: Annotated[float | None, AfterValidator(_tau), Field(description=(
        "Tau: the first token's top-2 log-prob margin under which the exact answer is sent "
        "instead (0: never; None: the served model's calibrated tau)"))] = None
    tenant: Annotated[str | None, AfterValidator(_tenant), Field(description=(
        "The tenant of requests that name none, and of api_key (None: the shared one)"))] = None
    block_size: Annotated[int | None, Field(strict=True, ge=1, description=(
        "The server's KV block size in tokens (None: read once from its /metrics)"))] = None
    model: Annotated[str | None, Field(description=(
        "The served model's name (None: read once from its /v1/models)"))] = None
    api_key: Annotated[Key, Field(description=(
        "The key clients must send (Authorization: Bearer KEY) on /v1 and /kvnotes (None: no "
        "key, unless key_file)"))] = None
    key_file: Annotated[Path | None, Field(description=(
        'A JSON file {"keys": {"KEY": {"tenant": "NAME"}}}: each key\'s requests are spliced '
        "in its tenant"))] = None
    metrics_key: Annotated[Key, Field(description=(
        "A key for /metrics alone (a scraper's); with keys on (or this set), /metrics needs it "
        "or api_key"))] = None
    upstream_api_key: Annotated[str | None, Field(description=(
        "The key sent to vLLM on every request (None: none; a client's own Authorization "
        "header is passed on only when the front checks no key)"))] = None
    timeout: Annotated[Seconds, Field(description=(
        "Seconds the front waits for vLLM's next bytes (504 past it)"))] = 600.0
    request_timeout: Annotated[Seconds, Field(description=(
        "Seconds one request may take in all, its answer included (504 past it, or a stream "
        "ends with an error event and [DONE])"))] = 3600.0
    connect_timeout: Annotated[Seconds, Field(description=(
        "Seconds to connect to vLLM (502 when it refuses, 504 past it)"))] = 5.0
    discover_timeout: Annotated[Seconds, Field(description=(
        "Seconds one read of vLLM's /metrics or /v1/models may take"))] = 5.0
    max_body_bytes: Annotated[Count, Field(description=(
        "The largest request body (413 beyond it, checked while reading)"))] = 8 << 20
    body_timeout: Annotated[Seconds, Field(description=(
        "Seconds a client may take to send its body (408 past it)"))] = 30.0
    max_json_depth: Annotated[Count, Field(description=(
        "The deepest nesting of a body's JSON (400 beyond it)"))] = 64
    max_concurrent: Annotated[Count, Field(description=(
        "Requests in flight on /v1 (429 beyond it)"))] = 512
    max_connections: Annotated[Count, Field(description=(
        "Connections plus requests served at once (503 beyond it)"))] = 2048
    max_connections_per_ip: Annotated[int | None, Field(strict=True, ge=1, description=(
        "Connections one address may hold open (one beyond it is closed at once; None: no "
        "cap). Behind a reverse proxy every client has the proxy's address: raise it or set "
        "None there"))] = 1024
    head_timeout: Annotated[Seconds, Field(description=(
        "Seconds a client may take to send a request's line and headers (the connection is "
        "closed past it)"))] = 10.0
    max_drain_bytes: Annotated[Count, Field(description=(
        "A body refused as too large (413) is read and discarded up to this size first, so "
        "the client reads its 413 instead of a reset connection"))] = 16 << 20
    backlog: Annotated[Count, Field(description=(
        "The listen backlog (a burst of connections waits, not reset)"))] = 2048
    keep_alive_s: Annotated[Seconds, Field(description=(
        "Seconds an idle keep-alive connection is held: longer than common clients' idle "
        "expiry (httpx and the openai SDK: 5 s), so a client never reuses a connection the "
        "server is closing"))] = 15.0
    max_header_bytes: Annotated[Count, Field(description=(
        "The most of a request head buffered before it is complete (400 beyond it)"))] = (
        16 << 10)
    upstream_connections: Annotated[Count, Field(description=(
        "The pool of connections to vLLM"))] = 512
    plan_workers: Annotated[Count, Field(description=(
        "Threads that plan requests (sharing one tokenizer)"))] = 4
    max_plans_per_client: Annotated[int | None, Field(strict=True, ge=1, description=(
        "Plans of one client (its key, or its address without keys) on or waiting for a "
        "planning thread at once (None: plan_workers - 1, at least 1)"))] = None
    plan_timeout: Annotated[Seconds, Field(description=(
        "Seconds one request's planning may take (413 past it)"))] = 10.0
    part_cache_chars: Annotated[int, Field(strict=True, ge=0, description=(
        "Characters of prompt parts whose token ids the planner keeps, least recently used "
        "dropped (about 2 bytes each; 0: none kept)"))] = PART_CACHE_CHARS
    max_tools: Annotated[Count, Field(description="Tools in one chat (400 beyond it)")] = 128
    max_tool_depth: Annotated[Count, Field(description=(
        "The deepest nesting of one tool's JSON (400 beyond it)"))] = 16
    max_messages: Annotated[Count, Field(description=(
        "Messages in one chat (400 beyond it)"))] = 1024
    max_content_parts: Annotated[Count, Field(description=(
        "Content parts in all of one chat's messages (400 beyond it)"))] = 512
    max_prompt_tokens: Annotated[Count, Field(description=(
        "Tokens of a prompt the front lays out (413 beyond it)"))] = 131072
    learn: Annotated[LearnConfig | None, Field(description=(
        "Learn the chunks requests carry (None: off, only registered skills are spliced); "
        "needs the engine: the launcher's front learns"))] = None
    store: Annotated[str | None, Field(description=(
        "A Redis store a fleet of hosts shares (redis://HOST:PORT/DB, rediss:// for TLS; the "
        "password in the URL or in password_file): its entries are mirrored into the serving "
        "folder in the background, and with learning, sightings, compiles and the library's "
        "bounds are the fleet's. None: this host's folder alone"))] = None
    store_password_file: Annotated[Path | None, Field(description=(
        "A file whose first line is the store's password (kept out of the URL and the "
        "process list)"))] = None
    mirror_bytes: Annotated[Size, Field(description=(
        "The entries this host copies from the store, in all (e.g. 8GiB)"))] = (
        DEFAULT_MIRROR_BYTES)

    def __post_init__(self) -> None:
        """The checks that read two fields (each field's own are its constraints)."""
        self._check_store()
        self._check_quotas()

    def _check_quotas(self) -> None:
        """A tenant quota is a guarantee only while every tenant's quota fits under the
        library's cap: with keys (so the tenants are known), a cap below the quotas' sum is
        refused. Without keys, requests name their tenants and the guarantee holds for up to
        ``library_cap // tenant_quota`` of them (docs/guide/learning.md)."""
        learn = self.learn
        if learn is None or learn.library_cap is None or learn.tenant_quota is None:
            return
        keys = Keys.of(self)
        if not keys.enabled:
            return
        tenants = len(keys.tenants)
        need = learn.tenant_quota * tenants
        if learn.library_cap < need:
            raise InvalidArgumentError(
                f"learning.library_cap {format_size(learn.library_cap)} is below the tenant "
                f"quotas' sum {format_size(need)} ({tenants} tenants x "
                f"{format_size(learn.tenant_quota)}): a tenant within its quota could lose "
                "entries to another's; raise the cap or lower the quota")

    def _check_store(self) -> None:
        """A password file needs a store, and a store is a Redis URL: a malformed URL, or a
        folder where a Redis URL belongs, fails at start; a store that is down does not (the
        host serves without it until it answers)."""
        if self.store_password_file is not None and self.store is None:
            raise InvalidArgumentError("FrontConfig.store_password_file is the store's: "
                                       "set FrontConfig.store (redis://...) too")
        if self.store is not None:
            from kvnotes.serving.store.url import parse_store_url

            if not parse_store_url(self.store).is_redis:
                raise InvalidArgumentError("FrontConfig.store takes a redis:// or rediss:// "
                                           "URL (the host's own folder is its skills folder)")

    def repair_for(self, first: int | None) -> Repair:
        """The repair a request gets: ``repair``, or, when the request names its first tokens
        (``kvnotes.repair``), exactly those (``Repair(first=K)``, the meaning of an int repair
        everywhere)."""
        return self.repair if first is None else Repair(first=first)

    def guard_tau(self, served: str | None = None) -> float:
        """The guard's tau: ``guard`` when set, else the calibrated one of ``model`` (or of
        ``served``, the name vLLM serves, when ``model`` is None:
        :func:`~kvnotes.serving.front.guard_defaults.default_guard`), 0 when neither is known.

        Example:
            >>> FrontConfig(model="qwen2.5-coder-0.5b").guard_tau(), FrontConfig().guard_tau()
            (0.4, 0.0)
        """
        if self.guard is not None:
            return self.guard
        model = self.model or served
        return 0.0 if model is None else default_guard(model)[0]

    @property
    def keys(self) -> Keys:
        """The keys clients may send (read from ``key_file`` at each call)."""
        return Keys.of(self)


class Keys:
    """The accepted keys and each one's tenant; :meth:`tenant_of` looks a key up."""

    def __init__(self, keys: dict[str, str | None]) -> None:
        # hashed: a lookup compares digests in constant time, never the keys themselves
        self._tenants = {key_digest(k): t for k, t in keys.items()}

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def __len__(self) -> int:
        return len(self._tenants)

    @property
    def tenants(self) -> frozenset[str | None]:
        """The tenants the keys name (None: the shared one)."""
        return frozenset(self._tenants.values())

    def tenant_of(self, key: str) -> tuple[bool, str | None]:
        """``(known, tenant)`` of a presented key."""
        want = key_digest(key)
        for digest, tenant in self._tenants.items():
            if hmac.compare_digest(digest, want):
                return True, tenant
        return False, None

    @classmethod
    def of(cls, config: FrontConfig) -> Keys:
        keys: dict[str, str | None] = {}
        if config.key_file is not None:
            keys.update(read_key_file(config.key_file))
        if config.api_key is not None:
            keys[config.api_key] = config.tenant
        return cls(keys)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


_KEY = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no blank: what a header carries intact


def check_key(key: str, where: str) -> str:
    """``key`` when a client can send it as ``Authorization: Bearer <key>`` and have it match:
    printable ASCII with no blank (an HTTP header's value is stripped of blanks around it, and
    a non-ASCII key arrives as other characters); :class:`InvalidArgumentError` naming
    ``where`` (never the key) otherwise.

    Example:
        >>> check_key("sk-acme-1", "api_key")
        'sk-acme-1'
    """
    if not isinstance(key, str) or not key.strip():
        raise InvalidArgumentError(f"{where} is empty: give a key")
    if key != key.strip():
        raise InvalidArgumentError(f"{where} has blanks around it: remove them (a client's "
                                   "header never carries them)")
    if not _KEY.fullmatch(key):
        raise InvalidArgumentError(f"{where} holds a blank or a character that is not "
                                   "printable ASCII: use letters, digits and punctuation only")
    return key


def read_key_file(path: str | os.PathLike[str]) -> dict[str, str | None]:
    """``{key: tenant}`` of a key file (``{"keys": {"<key>": {"tenant": "acme"}}}``)."""
    path = Path(path)
    try:
        raw: Any = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise InvalidArgumentError(f"key file {path}: {err}; write "
                                   '{"keys": {"<key>": {"tenant": "<name>"}}}') from err
    entries = raw.get("keys") if isinstance(raw, dict) else None
    if not isinstance(entries, dict) or not entries:
        raise InvalidArgumentError(f"key file {path}: no keys; write "
                                   '{"keys": {"<key>": {"tenant": "<name>"}}}')
    out: dict[str, str | None] = {}
    for i, (key, entry) in enumerate(entries.items()):
        check_key(key, f"key file {path}: key #{i + 1}")
        if not isinstance(entry, dict) or set(entry) - {"tenant"}:
            raise InvalidArgumentError(f"key file {path}: each key maps to "
                                       '{"tenant": "<name>"} or {} (the shared tenant)')
        tenant = entry.get("tenant")
        splice_salt(tenant)  # the tenant's spelling rule
        out[key] = tenant
    return out
