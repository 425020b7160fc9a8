"""The front's settings (:class:`FrontConfig`, every limit a named field) and its keys.

Keys: with ``api_key`` or ``key_file`` set, every ``/v1`` and ``/kvnotes`` request needs
``Authorization: Bearer <key>`` (401 otherwise). The key file maps keys to tenants::

    {"keys": {"sk-acme-1": {"tenant": "acme"}, "sk-globex": {"tenant": "globex"},
              "sk-ops": {}}}

A request's tenant (its splice salt) is then its key's: ``api_key``'s is ``tenant``, a key with
no tenant is in the shared one. :class:`Keys` looks a presented key up.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import DEFAULT_FIRST, DEFAULT_SHARE, Repair
from kvnotes.core.sizes import parse_size
from kvnotes.serving.front.guard_defaults import default_guard
from kvnotes.serving.library.manifest import splice_salt
from kvnotes.serving.planning.part_tokens import DEFAULT_CHARS as PART_CACHE_CHARS
from kvnotes.serving.planning.phases import check_tau
from kvnotes.serving.upstream import check_loopback_url

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


@dataclass(frozen=True, slots=True)
class LearnConfig:
    """How the front learns the chunks it sees (:mod:`kvnotes.serving.learning`).

    Args:
        after: the sighting (per tenant) at which a chunk is compiled, in the background.
        min_tokens: chunks shorter than this are never learned.
        library_cap: bytes of learned entries the serving folder may hold (least recently
            used evicted beyond it; the operator's registered skills never are, nor pinned
            entries, nor entries a running request was planned with). None: no cap.
        tenant_quota: bytes of learned entries one tenant may hold (the shared tenant
            included). None: no quota.
        max_tracked: chunks whose sightings are counted in memory (least recently seen
            forgotten beyond it).
        queue_size: compile jobs waiting for the worker (a job beyond it is dropped, counted,
            and queued again at a later sighting).
        flush_s: how often, at most, hit counts are written to the registry.
        max_variants: learned entries kept per skill (its variants: the skill compiled behind
            each predecessor seen ``after`` times before it, and the chunk learned itself);
            the least recently used beyond it is evicted (pinned and leased ones are kept).
        compile_nice: the nice value of the compile thread (Linux sets it per thread, and
            the threads it starts inherit it). On an idle CPU a compile runs at full speed at
            any value; on a core that a serving thread keeps busy, the kernel's scheduler
            gives the compile a share of that core fixed by this value
            (:func:`busy_core_share`: 3.4% at the default 15), so it costs concurrent requests
            at most about that share of their CPU and still always finishes. At 19 (1.4%) a
            compile under saturating load barely progresses; at 0 (50%) it delays concurrent
            first tokens (measured figures: docs/results/areas/learning.md, "Learning under load").
        block_size: vLLM's KV block size for a server launched to learn when its
            ``LaunchConfig.block_size`` is None (:data:`LEARN_BLOCK_SIZE`: short chunks lose
            less of their spliced share to rounding at small blocks).
    """

    after: int = 2
    min_tokens: int = 32
    library_cap: int | None = None
    tenant_quota: int | None = None
    max_tracked: int = 100_000
    queue_size: int = 64
    flush_s: float = 5.0
    max_variants: int = 4
    compile_nice: int = DEFAULT_COMPILE_NICE
    block_size: int = LEARN_BLOCK_SIZE

    def __post_init__(self) -> None:
        for name in ("after", "min_tokens", "max_tracked", "queue_size", "max_variants",
                     "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"LearnConfig.{name} must be a positive integer, "
                                           f"got {value!r}")
        for name in ("library_cap", "tenant_quota"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse_size(value, f"LearnConfig.{name}"))
        if not float(self.flush_s) > 0:
            raise InvalidArgumentError("LearnConfig.flush_s must be a positive number of "
                                       "seconds")
        nice = self.compile_nice
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise InvalidArgumentError(f"LearnConfig.compile_nice must be an integer from 0 "
                                       f"to 19, got {nice!r}")


@dataclass(frozen=True, slots=True)
class FrontConfig:
    """How the front runs.

    Args:
        upstream: the vLLM server's URL (loopback only; None in a ``LaunchConfig``, whose
            launcher fills in the server it starts).
        port: the front's port (None: a free one).
        host: the address it listens on (``0.0.0.0``: every interface; set a key then).
        repair: the first tokens of each spliced skill recomputed (a request's
            ``kvnotes.repair`` overrides it: that request recomputes its first ``K`` tokens and
            no share; 0: a bare splice).
        repair_share: the share floor: each skill's first ``max(repair, ceil(share * len))``
            tokens are recomputed, rounded up to the block (``Repair.share``; 0: the fixed
            count).
        guard: tau, the first token's top-2 log-prob margin under which the exact answer is
            sent instead (a request's ``kvnotes.guard`` overrides it; 0: never; None: the
            served model's calibrated tau, :meth:`guard_tau`).
        tenant: the tenant of requests that name none, and of ``api_key`` (None: shared).
        block_size: the server's KV block size (None: read once from its ``/metrics``).
        model: the served model's name (None: read once from its ``/v1/models``).
        api_key: the key clients must send (None: no key, unless ``key_file``).
        key_file: a JSON file of keys and their tenants (see the module docstring).
        metrics_key: a key for ``/metrics`` alone (a scraper's); with keys on (or this set),
            ``/metrics`` needs it or ``api_key`` (the operator's), 401 otherwise.
        upstream_api_key: the key sent to vLLM on every request (None: none; the client's own
            ``Authorization`` header is passed on only when the front checks no key).
        timeout: seconds the front waits for vLLM's next bytes (read); 504 past it.
        request_timeout: seconds one request may take in all, its answer included (a vLLM
            that trickles its answer byte by byte never trips ``timeout``); past it a 504, or
            a stream already begun ends with an error event and ``[DONE]``.
        connect_timeout: seconds to connect to vLLM; 502 when it refuses, 504 past it.
        discover_timeout: seconds one read of vLLM's ``/metrics`` or ``/v1/models`` may take.
        max_body_bytes: the largest request body (413 beyond it, checked while reading).
        body_timeout: seconds a client may take to send its body (408 past it).
        max_json_depth: the deepest nesting of a body's JSON (400 beyond it).
        max_concurrent: requests in flight on ``/v1`` (429 beyond it).
        max_connections: connections plus requests uvicorn serves at once (503 beyond it).
        max_connections_per_ip: connections one address may hold open (one beyond it is
            closed at once; None: no cap). Behind a reverse proxy every client has the
            proxy's address: raise it or set None there.
        head_timeout: seconds a client may take to send a request's head (its line and
            headers); a connection whose head is not whole by then is closed.
        max_drain_bytes: a body refused as too large (413) is read and discarded up to this
            size first, so the client reads its 413 instead of a reset connection.
        backlog: the listen backlog (a burst of connections waits, not reset).
        keep_alive_s: seconds an idle keep-alive connection is held. Longer than the idle
            expiry of common clients (httpx and the ``openai`` SDK drop idle connections after
            5 s): a server that closes an idle connection at the same moment a client reuses
            it makes that request fail ("Server disconnected without sending a response").
        max_header_bytes: the most of a request head (line and headers) buffered before it is
            complete (h11's bound: a longer head is refused with 400 as it arrives).
        upstream_connections: the pool of connections to vLLM.
        plan_workers: threads that plan requests (each with its own tokenizer copy).
        max_plans_per_client: plans of one client (its key, or its address without keys)
            waiting for or on a planning thread at once; its other requests wait behind them
            (None: ``plan_workers - 1``, at least 1, so one thread is always left to others).
        plan_timeout: seconds one request's planning may take (413 past it); a plan also
            stops when its client leaves.
        part_cache_chars: the characters of prompt parts whose token ids the planner keeps
            (:class:`~kvnotes.serving.planning.part_tokens.PartTokenCache`, least recently used
            dropped; about 2 bytes of memory each): a part seen again (each is tokenized
            alone) is not tokenized again (0: none kept).
        max_tools: tools in one chat (400 beyond it).
        max_tool_depth: the deepest nesting of one tool's JSON (400 beyond it).
        max_messages: messages in one chat (400 beyond it).
        max_content_parts: content parts in all of one chat's messages (400 beyond it).
        max_prompt_tokens: tokens of a prompt the front lays out (a chat, a completion text
            holding a registered skill, token ids; 413 beyond it).
        learn: learn the chunks requests carry (:class:`LearnConfig`; None: off, only
            registered skills are spliced). Needs the engine: the launcher's front learns.
        store: a Redis store a fleet of hosts shares (``redis://HOST:PORT/DB``, ``rediss://``
            for TLS; None: this host's folder alone): its entries are mirrored into the
            serving folder in the background, and with ``learn`` sightings, compiles and the
            library's bounds are the fleet's (:mod:`kvnotes.serving.front.store_link`).
        store_password_file: a file whose first line is the store's password.
        mirror_bytes: the entries this host copies from the store, in all (``8GiB``).
    """

    upstream: str | None = None
    port: int | None = None
    host: str = "127.0.0.1"
    repair: int = DEFAULT_FIRST
    repair_share: float = DEFAULT_SHARE
    guard: float | None = None
    tenant: str | None = None
    block_size: int | None = None
    model: str | None = None
    api_key: str | None = None
    key_file: Path | None = None
    metrics_key: str | None = None
    upstream_api_key: str | None = None
    timeout: float = 600.0
    request_timeout: float = 3600.0
    connect_timeout: float = 5.0
    discover_timeout: float = 5.0
    max_body_bytes: int = 8 << 20
    body_timeout: float = 30.0
    max_json_depth: int = 64
    max_concurrent: int = 512
    max_connections: int = 2048
    max_connections_per_ip: int | None = 1024
    head_timeout: float = 10.0
    max_drain_bytes: int = 16 << 20
    backlog: int = 2048
    keep_alive_s: float = 15.0
    max_header_bytes: int = 16 << 10
    upstream_connections: int = 512
    plan_workers: int = 4
    max_plans_per_client: int | None = None
    plan_timeout: float = 10.0
    part_cache_chars: int = PART_CACHE_CHARS
    max_tools: int = 128
    max_tool_depth: int = 16
    max_messages: int = 1024
    max_content_parts: int = 512
    max_prompt_tokens: int = 131072
    learn: LearnConfig | None = None
    store: str | None = None
    store_password_file: Path | None = None
    mirror_bytes: int = DEFAULT_MIRROR_BYTES  # or a size string: "8GiB"

    def __post_init__(self) -> None:
        self._check_store()
        if self.upstream is not None:
            check_loopback_url(self.upstream)
        self.repair_for(None)  # checks the count and the share
        if self.guard is not None:
            check_tau(self.guard)
        splice_salt(self.tenant)  # checks the spelling
        if self.block_size is not None and (isinstance(self.block_size, bool)
                                            or self.block_size < 1):
            raise InvalidArgumentError(f"block_size {self.block_size!r}: give the server's KV "
                                       "block size in tokens, or None to read it")
        for name in ("timeout", "connect_timeout", "discover_timeout", "body_timeout",
                     "keep_alive_s", "plan_timeout", "request_timeout", "head_timeout"):
            if not float(getattr(self, name)) > 0:
                raise InvalidArgumentError(f"FrontConfig.{name} must be a positive number of "
                                           "seconds")
        for name in ("max_body_bytes", "max_json_depth", "max_concurrent", "max_connections",
                     "backlog", "max_header_bytes", "upstream_connections", "plan_workers",
                     "max_tools", "max_tool_depth", "max_messages",
                     "max_content_parts", "max_prompt_tokens", "max_drain_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"FrontConfig.{name} must be a positive integer, "
                                           f"got {value!r}")
        for name in ("api_key", "metrics_key"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_key(value, f"FrontConfig.{name}"))
        chars = self.part_cache_chars
        if isinstance(chars, bool) or not isinstance(chars, int) or chars < 0:
            raise InvalidArgumentError(f"FrontConfig.part_cache_chars must be an integer >= 0, "
                                       f"got {chars!r}")
        for name in ("max_connections_per_ip", "max_plans_per_client"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise InvalidArgumentError(f"FrontConfig.{name} must be a positive integer "
                                           f"or None, got {value!r}")
        if self.key_file is not None:
            object.__setattr__(self, "key_file", Path(self.key_file))

    def _check_store(self) -> None:
        """A malformed store URL, or a folder where a Redis URL belongs, fails at start; a
        store that is down does not (the host serves without it until it answers)."""
        object.__setattr__(self, "mirror_bytes",
                           parse_size(self.mirror_bytes, "FrontConfig.mirror_bytes"))
        if self.store_password_file is not None:
            if self.store is None:
                raise InvalidArgumentError("FrontConfig.store_password_file is the store's: "
                                           "set FrontConfig.store (redis://...) too")
            object.__setattr__(self, "store_password_file", Path(self.store_password_file))
        if self.store is not None:
            from kvnotes.serving.store.url import parse_store_url

            if not parse_store_url(self.store).is_redis:
                raise InvalidArgumentError("FrontConfig.store takes a redis:// or rediss:// "
                                           "URL (the host's own folder is its skills folder)")

    def repair_for(self, first: int | None) -> Repair:
        """The repair a request gets: ``Repair(first=repair, share=repair_share)``, or, when the
        request names its first tokens (``kvnotes.repair``), exactly those (``Repair(first=K)``,
        the meaning of an int repair everywhere)."""
        if first is None:
            return Repair(first=self.repair, share=self.repair_share)
        return Repair(first=first)

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
