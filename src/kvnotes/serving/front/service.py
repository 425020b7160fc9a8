"""The front's work on a request, apart from HTTP: keys and tenants, counting, planning.

:class:`FrontService` holds what one front shares across requests (its config, the skill
catalog, the keys, the metrics, the pooled client to vLLM, the planning threads) and answers a
checked body: planned on a small thread pool (each thread with its own tokenizer copy, no
global lock), then spliced, or answered exactly with the reason
(:class:`~kvnotes.serving.front.proxy.Proxy`): forwarded as it came, or, for a structured
chat (tools, content parts, no chat template) or a completion text containing a registered
skill, its same part-wise ids sent unspliced.
:class:`~kvnotes.serving.front.app.Front` holds one and serves it over HTTP: its routes call
the public methods here (:meth:`FrontService.open_call`, :meth:`FrontService.admission`,
:meth:`FrontService.answer`, :meth:`FrontService.models`, ...), never its state.

Keys and tenants (:mod:`~kvnotes.serving.front.config`): with keys on, a request's tenant is
its key's (a ``kvnotes.tenant`` naming another is a 400), and a tenant's exact requests are
salted as its own too.

Learning (a :class:`~kvnotes.serving.learning.Learner`, with ``--learn``): every request's
chunks are counted (:meth:`FrontService.observe`, in memory: compiles run on the learner's own
thread), and a spliced request holds a lease on the entries it was planned with until it ends.
A planned request's (predecessor, skill) pairs that a variant would splice better
(:func:`~kvnotes.serving.planning.variant_demand.variant_candidates`) are counted too
(:meth:`Learner.observe_variants`), and learned the same way.

Every spliced request's entries are counted in :attr:`FrontService.variant_hits` (spliced,
exactly placed: the hit rate of each variant), learning on or off; ``/metrics`` shows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvnotes.core.errors import KvnotesError, ServingError
from kvnotes.serving.front.admission import Admission, Slots
from kvnotes.serving.front.call import JSON, Call, Reply
from kvnotes.serving.front.config import FrontConfig, Keys, key_digest
from kvnotes.serving.front.errors import ApiError, header_value
from kvnotes.serving.front.limits import DeadlineTokenizer, PlanDeadline, PlanStopped, PlanTurns
from kvnotes.serving.front.prometheus import FrontMetrics
from kvnotes.serving.front.proxy import Proxy
from kvnotes.serving.front.store_link import link_for
from kvnotes.serving.front.vllm_client import HEALTH, MODELS, Upstream
from kvnotes.serving.json_types import JsonObject, RequestBody
from kvnotes.serving.library.manifest import SPLICE_SALT
from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.planning.front_plan import FrontPlan, catalog_view, plan_request
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.planning.part_tokens import PartTokenCache
from kvnotes.serving.planning.request import (
    OPTIONS_KEY,
    FrontOptions,
    FrontRequest,
    Unplannable,
    read_options,
    read_request,
)
from kvnotes.serving.planning.variant_demand import VariantHits, variant_candidates
from kvnotes.serving.protocol import Outcome

if TYPE_CHECKING:
    from kvnotes.serving.learning import Learner

TENANT_SALT = "kvnotes-tenant"  # a tenant's exact requests: kvnotes-tenant:<tenant>[:<salt>]
_TENANT_SALTS = (f"{SPLICE_SALT}:", f"{TENANT_SALT}:")
log = logging.getLogger("kvnotes.serving.front")


def why_not(err: Exception, request_id: str = "") -> Unplannable:
    """Why a request is answered exactly, from what its planning raised: an
    :class:`Unplannable` as it is, a kvnotes or value error as ``not_planned``, anything else as
    ``plan_error`` (logged with its traceback: planning should not fail)."""
    if isinstance(err, Unplannable):
        return err
    if isinstance(err, KvnotesError):
        return Unplannable(f"not planned: {err}")
    if isinstance(err, ValueError):  # its text may quote the request: the log keeps it
        log.info("request %s: not planned: %s", request_id, err)
        return Unplannable(f"not planned: {type(err).__name__}")
    log.error("request %s: planning failed; answered exactly", request_id, exc_info=err)
    return Unplannable(f"planning failed: {type(err).__name__}", "plan_error")


class FrontService:
    """One front's shared state and its answer to a checked request (see the module
    docstring)."""

    def __init__(self, config: FrontConfig, catalog: SkillCatalog,
                 learner: Learner | None = None) -> None:
        if config.upstream is None:
            raise ServingError("FrontConfig.upstream is None: give the vLLM server's URL")
        self.config, self.catalog = config, catalog
        self.upstream = config.upstream.rstrip("/")
        self.keys: Keys = config.keys  # read once: a bad key file fails here, not per request
        self.metrics = FrontMetrics()
        self.up = Upstream(config)
        self._pool: ThreadPoolExecutor | None = None
        # prompt parts' ids, shared by the planning threads as their one tokenizer is
        self.part_cache = (PartTokenCache(config.part_cache_chars) if config.part_cache_chars
                           else None)
        self.slots = Slots(config.max_concurrent, self.metrics.in_flight.inc)
        per_client = config.max_plans_per_client
        self.plan_turns = PlanTurns(max(1, config.plan_workers - 1) if per_client is None
                                    else per_client)
        self.proxy = Proxy(self.up, self.metrics)
        self.learner = learner
        if learner is not None:
            self.metrics.watch_learner(learner.counters)
        self.variant_hits = VariantHits()
        if learner is not None:  # a learned entry's counts go when it does, not at a scrape
            learner.on_gone(lambda keys: self.variant_hits.forget(*keys))
        learned = None if learner is None else learner.registry.__contains__
        self.metrics.watch_variants(self.variant_hits, getattr(catalog, "folder", None), learned)
        # a fleet's shared store (FrontConfig.store): mirrored into the folder, in /metrics
        self.store = link_for(config, catalog, learner)
        if self.store is not None:
            self.metrics.watch_store(self.store.collector(), self.store.stats)

    @property
    def stats(self) -> Counter[str]:
        """Requests by outcome (a copy)."""
        return Counter(self.metrics.counts)

    async def opened(self) -> None:
        """Inside the serving loop, before the first request."""
        self._pool = ThreadPoolExecutor(self.config.plan_workers, thread_name_prefix="kvnotes-plan")
        await self.up.open()
        if self.store is not None:
            self.store.start()
        if self.learner is not None:
            self.learner.start()
        with contextlib.suppress(Exception):  # vLLM may not be up yet: read again when needed
            await asyncio.wait_for(self.up.discover(), self.config.discover_timeout)

    async def closed(self) -> None:
        if self.learner is not None:
            self.learner.stop()
        if self.store is not None:
            self.store.stop()
        await self.up.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ---- keys ------------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant of a request's key; 401 when keys are on and it has none that is known."""
        if not self.keys.enabled:
            return self.config.tenant
        scheme, _, key = (authorization or "").partition(" ")
        known, tenant = self.keys.tenant_of(key.strip()) if scheme.lower() == "bearer" \
            else (False, None)
        if not known:
            raise ApiError(401, "a valid API key is needed: send Authorization: Bearer <key>")
        return tenant

    def authorize_metrics(self, authorization: str | None) -> None:
        """401 unless ``/metrics`` is open (no keys, no metrics key) or the request carries the
        metrics key or the operator's (``api_key``)."""
        c = self.config
        allowed = [k for k in (c.metrics_key, c.api_key) if k is not None]
        if not self.keys.enabled and c.metrics_key is None:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and any(
                hmac.compare_digest(key_digest(key.strip()), key_digest(a)) for a in allowed):
            return
        raise ApiError(401, "/metrics needs the metrics key (FrontConfig.metrics_key) or the "
                       "operator's (FrontConfig.api_key): send Authorization: Bearer <key>")

    def tenant_of(self, opts: FrontOptions, key_tenant: str | None) -> str | None:
        """The request's tenant: its key's when keys are on (a different ``kvnotes.tenant`` is
        a 400), else the one it names, else the front's."""
        if self.keys.enabled:
            if opts.tenant is not None and opts.tenant != key_tenant:
                raise ApiError(400, f"{OPTIONS_KEY}.tenant {opts.tenant!r} is not this key's "
                               "tenant: leave it out (the key sets the tenant)",
                               f"{OPTIONS_KEY}.tenant")
            return key_tenant
        return opts.tenant if opts.tenant is not None else self.config.tenant

    def exact_salt(self, tenant: str | None, client_salt: object) -> str | None:
        """The ``cache_salt`` of an exact request when keys are on: the tenant's own (a client's
        salt inside it), so no tenant shares another's cached blocks; ``client_salt`` otherwise."""
        if not self.keys.enabled:
            return client_salt if isinstance(client_salt, str) else None
        if tenant is None:
            # the shared tenant may not name a tenant's salts (it would hit that tenant's blocks)
            if isinstance(client_salt, str) and client_salt.startswith(_TENANT_SALTS):
                raise ApiError(400, f"cache_salt values starting with {_TENANT_SALTS} are "
                               "the front's own", "cache_salt")
            return client_salt if isinstance(client_salt, str) else None
        base = f"{TENANT_SALT}:{tenant}"
        return base if not isinstance(client_salt, str) else f"{base}:{client_salt}"

    def client_of(self, authorization: str | None, address: str) -> str:
        """Who a request is, for sharing the planning threads: its key (a digest) when keys
        are on, else its address."""
        if self.keys.enabled and authorization:
            return "key:" + hashlib.blake2b(authorization.encode("utf-8", "replace"),
                                            digest_size=16).hexdigest()
        return "ip:" + address

    def upstream_auth(self, client_auth: str | None) -> str | None:
        """The ``Authorization`` passed on to vLLM: the client's own only when the front checks
        none of its own (a front key is never vLLM's)."""
        return None if self.keys.enabled else client_auth

    # ---- what the routes ask ---------------------------------------------------------------
    def open_call(self, route: str, request_id: str | None, authorization: str | None,
                  address: str) -> tuple[Call, str | None]:
        """A new ``/v1`` request's record and its key's tenant; a 401 (counted as
        ``unauthorized``) when keys are on and it carries none that is known."""
        call = self.new_call(route, request_id)
        try:
            key_tenant = self.authenticate(authorization)
        except ApiError:
            self.metrics.outcome(route, Outcome.UNAUTHORIZED)
            raise
        call.client = self.client_of(authorization, address)
        return call, key_tenant

    async def models(self, authorization: str | None) -> Reply:
        """vLLM's ``/v1/models``, for a request that may see it."""
        self.authenticate(authorization)
        status, data, ctype = await self.up.get(
            MODELS, headers=self.up.headers(self.upstream_auth(authorization)))
        return Reply(status, {"content-type": ctype or JSON}, data)

    async def health(self) -> Reply:
        """vLLM's ``/health``."""
        status, data, ctype = await self.up.get(HEALTH, timeout=self.config.discover_timeout)
        return Reply(status, {"content-type": ctype or "text/plain"}, data)

    def metrics_text(self, authorization: str | None) -> bytes:
        """The Prometheus exposition of the front's metrics (401 without the metrics key when
        it is needed: :meth:`authorize_metrics`)."""
        self.authorize_metrics(authorization)
        return self.metrics.exposition()

    def stats_for(self, authorization: str | None) -> JsonObject:
        """The front's counters, for a request that may see them."""
        self.authenticate(authorization)
        return self.metrics.stats()

    # ---- requests --------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests holding a slot now (their :class:`Admission` the only place it changes)."""
        return self.slots.in_flight

    def admission(self, call: Call) -> Admission:
        """The context a request runs in: its slot (429 when none is free), given back and
        the call finished (:meth:`finish`) when the context exits, however it ends."""
        return Admission(self.slots, call, self.finish,
                         rejected=lambda c: self.metrics.outcome(c.route, Outcome.REJECTED))

    def first_bytes(self, call: Call) -> None:
        """The answer's first bytes go out now (its time to first token)."""
        self.metrics.ttft.labels(call.route).observe(time.perf_counter() - call.t0)

    def finish(self, call: Call) -> None:
        """A request's end: its leases, its metrics and its log line (once, before its last
        bytes are sent, so a client that has its answer sees it counted; the slot is its
        :class:`Admission`'s)."""
        if call.finished:
            return
        call.finished = True
        if call.leased and self.learner is not None:
            self.learner.release(call.leased)
            call.leased = ()
        m = self.metrics
        if call.first_upstream is not None:
            m.overhead.labels(call.route).observe(call.first_upstream - call.t0)
        outcome = call.outcome or Outcome.INTERNAL_ERROR
        m.outcome(call.route, outcome, call.reason)
        log.info("request %s", json.dumps({
            "id": call.id, "route": call.route, "tenant": call.tenant, "status": call.status,
            "outcome": outcome, "reason": call.reason, "plan": call.plan_summary(),
            "ms": round((time.perf_counter() - call.t0) * 1e3, 2)}))

    def new_call(self, route: str, request_id: str | None) -> Call:
        rid = header_value(request_id, 64) if request_id else ""
        return Call(route, rid or uuid.uuid4().hex)

    async def answer(self, kind: str, data: RequestBody, call: Call,
                     key_tenant: str | None, client_auth: str | None) -> Reply:
        """The answer to a checked body: spliced, or forwarded exactly with the reason."""
        opts = read_options(data.get(OPTIONS_KEY))
        tenant = call.tenant = self.tenant_of(opts, key_tenant)
        exact = data.copy()
        exact.pop(OPTIONS_KEY, None)
        salt = self.exact_salt(tenant, exact.get("cache_salt"))
        if salt is not None:
            exact["cache_salt"] = salt
        try:
            block_size: int | Unplannable = Unplannable(f"{OPTIONS_KEY}.splice is false",
                                                        "opted_out")
            if opts.splice:
                try:
                    block_size = await self.up.block_size()
                except Unplannable as err:  # sent as its own ids, it is answered exactly
                    block_size = err
            req, fp = await self._planned(call, kind, data, opts, tenant, block_size)
            model = str(req.sampling.get("model") or await self.up.model())
            tau = 0.0 if isinstance(fp, Unplannable) else await self.guard_of(opts)
        except ApiError:  # a request beyond the front's bounds
            raise
        except Exception as err:  # noqa: BLE001 -- planning is an optimization: exact instead
            return await self.proxy.forward(kind, exact, call, why_not(err, call.id),
                                            self.upstream_auth(client_auth))
        if isinstance(fp, Unplannable):
            return await self.proxy.exact(req, model, call, fp, salt)
        used, exact_keys = self.variant_hits.record(fp.parts)
        if self.learner is not None:  # the entries it was planned with stay until it ends
            call.leased = self.learner.lease(self.plan_keys(fp, tenant), used=used,
                                             exact=exact_keys)
        elif self.store is not None:  # the fleet's LRU (a fleet learner counts its own leases)
            self.store.mirror.used(used)
        call.plan = fp.wire()
        return await self.proxy.spliced(req, fp, model, tau, call, exact, salt)

    async def guard_of(self, opts: FrontOptions) -> float:
        """The guard's tau for a request: its ``kvnotes.guard``, else the front's
        (:meth:`FrontConfig.guard_tau`: the served model's calibrated one when none is set)."""
        if opts.guard is not None:
            return opts.guard
        c = self.config
        served = None if c.guard is not None or c.model is not None else await self.up.model()
        return c.guard_tau(served)

    async def _planned(self, call: Call, kind: str, data: RequestBody, opts: FrontOptions,
                       tenant: str | None, block_size: int | Unplannable
                       ) -> tuple[FrontRequest, FrontPlan | Unplannable]:
        """:meth:`_plan` on a planning thread, in its client's turn (:class:`PlanTurns`),
        stopped at ``plan_timeout`` (413) or when the client leaves."""
        deadline = PlanDeadline(self.config.plan_timeout)
        async with self.plan_turns.turn(call.client):
            future = asyncio.get_running_loop().run_in_executor(
                self._pool, self._plan, kind, data, opts, tenant, block_size, deadline)
            try:
                return await future
            except PlanStopped as err:
                raise ApiError(413, f"the request was not planned: {err} "
                               "(FrontConfig.plan_timeout); send fewer or shorter parts"
                               ) from err
            finally:  # done, or its client left: a plan still running stops at its next call
                deadline.cancel()

    def _plan(self, kind: str, data: RequestBody, opts: FrontOptions, tenant: str | None,
              block_size: int | Unplannable, deadline: PlanDeadline | None = None
              ) -> tuple[FrontRequest, FrontPlan | Unplannable]:
        """The request and its plan; for a request sent as its own ids
        (:attr:`FrontRequest.sent_as_ids`: a structured chat, a completion text with a
        registered skill) that is not spliced, why not (it is then sent exactly as the same
        ids). ``block_size``: why not, when unknown or opted out."""
        # shared by the planning threads: planning only encodes (it never sets truncation or
        # padding, the tokenizer's only state), and the Rust encode drops the GIL
        tokenizer = self.catalog.tokenizer
        if deadline is not None:
            deadline.start()
            tokenizer = DeadlineTokenizer(tokenizer, deadline)
        req = read_request(kind, data, tokenizer, find=catalog_view(self.catalog, tenant).find,
                           cache=self.part_cache)
        tokens = len(req.prompt_ids) if req.parts else 0
        if tokens > self.config.max_prompt_tokens:
            raise ApiError(413, f"the prompt has {tokens} tokens, more than "
                           f"{self.config.max_prompt_tokens} (FrontConfig.max_prompt_tokens)")
        self.observe(tenant, req.chunks)
        try:
            if isinstance(block_size, Unplannable):
                raise block_size
            repair = self.config.repair_for(opts.repair)
            fp = plan_request(req, self.catalog, repair, block_size, tenant, tokenizer,
                              self.part_cache)
            self.observe_variants(tenant, fp)
            return req, fp
        except PlanStopped:
            raise
        except Exception as err:  # noqa: BLE001 -- planning is an optimization: exact instead
            if req.sent_as_ids:  # answered exactly as the same ids, not forwarded
                return req, why_not(err)
            raise

    # ---- learning ------------------------------------------------------------------------
    def observe(self, tenant: str | None, chunks: Iterable[SeenChunk]) -> None:
        """Count a request's chunks for learning (in memory, never blocks; nothing when
        learning is off). Planned requests are observed here by :meth:`answer`; a path that
        sends a request exactly without planning it calls this itself."""
        if self.learner is not None:
            try:
                self.learner.observe(tenant, chunks)
            except Exception:  # noqa: BLE001 -- learning is an optimization: serve on
                log.exception("learner: a request's chunks were not counted")

    def observe_variants(self, tenant: str | None, fp: FrontPlan) -> None:
        """Count the variants ``fp`` would have spliced better with (nothing when learning is
        off; in memory, never blocks)."""
        if self.learner is not None:
            try:
                self.learner.observe_variants(tenant, variant_candidates(fp.spans, fp.ids))
            except Exception:  # noqa: BLE001 -- learning is an optimization: serve on
                log.exception("learner: a request's variants were not counted")

    def plan_keys(self, fp: FrontPlan, tenant: str | None) -> list[str]:
        """The keys of the entries ``fp`` splices (every anchoring of each spliced piece's
        tokens that ``tenant`` sees: the connector picks one of them)."""
        keys: list[str] = []
        for span in fp.spans:
            if span.is_piece:
                keys += self.catalog.keys_of(fp.ids[span.start:span.end], tenant)
        return keys
