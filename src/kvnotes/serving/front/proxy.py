"""What the front sends vLLM for one request, and what it answers the client with.

A request is either forwarded exactly (:meth:`Proxy.forward`: vLLM's answer relayed as it
comes, the reason in the :data:`REASON_HEADER` header) or spliced (:meth:`Proxy.spliced`: the
phase requests, then the real one, answered in the client's format by
:class:`~kvnotes.serving.front.format.Shaper`; when the guard fires, the exact request's answer
instead). A request the front sends as its own ids (``FrontRequest.sent_as_ids``: a
structured chat, with tools, content parts or no template; a completion text containing a
registered skill) that is not spliced is sent exactly by the front itself (:meth:`Proxy.exact`:
the same part-wise ids to ``/v1/completions``, no splice salt, answered in the client's
format), never forwarded for vLLM to tokenize or render. A stream holds its first token back
until the guard has decided; an upstream stream that breaks ends with an error event and ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeAlias, cast

from kvnotes.serving.front.answers import WrongShape, check_chunk, check_completion
from kvnotes.serving.front.body import no_constant
from kvnotes.serving.front.call import JSON, Call, Reply, json_reply
from kvnotes.serving.front.errors import ApiError, error_body, header_value
from kvnotes.serving.front.format import DONE, InvalidEvent, Shaper, first_top_logprobs, parse_sse_line, sse
from kvnotes.serving.front.prometheus import FrontMetrics
from kvnotes.serving.front.vllm_client import COMPLETIONS, ROUTES, Upstream
from kvnotes.serving.json_types import (
    Completion,
    CompletionChunk,
    ErrorEvent,
    JsonValue,
    RequestBody,
    UpstreamBody,
)
from kvnotes.serving.planning.front_plan import FrontPlan, exact_body, real_body
from kvnotes.serving.planning.phases import guard_fires
from kvnotes.serving.planning.request import FrontRequest, Unplannable
from kvnotes.serving.protocol import Outcome, ProtocolError, SpliceReport, UsageBuilder

log = logging.getLogger("kvnotes.front")
REASON_HEADER = "x-kvnotes"
# headers of vLLM's answers not passed on: hop-by-hop (RFC 9110 7.6.1) and those uvicorn sets
_DROP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                 "proxy-authenticate", "proxy-authorization", "content-length", "content-encoding",
                 "date", "server"}
# one event of vLLM's stream: a checked chunk, an error event, DONE, or what is not a chunk
Event: TypeAlias = "CompletionChunk | ErrorEvent | bytes | InvalidEvent"


class Proxy:
    """Forwards or splices one request through ``up``, counting spliced tokens in ``metrics``."""

    def __init__(self, up: Upstream, metrics: FrontMetrics) -> None:
        self.up, self.metrics = up, metrics

    async def forward(self, kind: str, body: RequestBody, call: Call, why: Unplannable,
                      auth: str | None) -> Reply:
        """The request passed to vLLM as it is (``auth``: the Authorization vLLM gets); its
        answer relayed as it comes."""
        call.outcome, call.reason = Outcome.FORWARDED, why.code
        call.upstream_started()
        resp = await self.up.open_stream("POST", ROUTES[kind], body, self.up.headers(auth))
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_HEADERS}
        headers[REASON_HEADER] = header_value(f"forwarded: {why.code}: {why}")
        if resp.status_code >= 500:
            call.outcome = Outcome.UPSTREAM_ERROR
        sse_stream = resp.headers.get("content-type", "").startswith("text/event-stream")
        return Reply(resp.status_code, headers, stream=self._relay(resp, sse_stream, call),
                     upstream=resp)

    async def _relay(self, resp: Any, sse_stream: bool, call: Call) -> AsyncGenerator[bytes, None]:
        import httpx2

        ended = False
        try:
            async for chunk in resp.aiter_bytes():
                ended = chunk.endswith(DONE) or ended and not chunk
                yield chunk
        except httpx2.HTTPError as err:
            call.outcome = Outcome.UPSTREAM_ERROR
            if sse_stream and not ended:
                yield sse(error_body(502, f"the vLLM server's stream broke: {type(err).__name__}"))
                yield DONE
        finally:
            await resp.aclose()

    async def spliced(self, req: FrontRequest, fp: FrontPlan, model: str, tau: float, call: Call,
                      exact: RequestBody, salt: str | None) -> Reply:
        info = UsageBuilder(spliced_tokens=fp.plan.spliced_tokens,
                            plan=fp.wire() if call.plan is None else call.plan)
        call.upstream_started()
        for body in fp.plan.phase_bodies(fp.ids, model):
            status, data = await self.up.post_json(COMPLETIONS, body)
            if status != 200:
                why = Unplannable(f"a phase failed: HTTP {status}: "
                                  f"{data[:200].decode(errors='replace')}", "phase_failed")
                if req.sent_as_ids:
                    reply = await self.exact(req, model, call, why, salt)
                else:
                    reply = await self.forward(req.kind, exact, call, why, None)
                if call.outcome in (Outcome.FORWARDED, Outcome.EXACT):
                    call.outcome = Outcome.PHASE_FAILED
                return reply
            info.phases += 1
            info.phase_reports.append(_phase_report(data, call))
        shaper = _shaper(req)
        headers = {REASON_HEADER: header_value(f"spliced {','.join(fp.skills)}")}
        exact_ids = exact_body(fp.ids, req, model)
        if salt is not None:
            exact_ids["cache_salt"] = salt
        if req.stream:
            info.no_report = "stream"
            return await self._stream(req, fp, model, tau, info, shaper, headers, call, exact_ids)
        status, data = await self.up.post_json(COMPLETIONS, real_body(fp, req, model, tau))
        if status != 200:
            return self._upstream_failed(status, data, call)
        answer = _loads(data)
        _answer_report(answer, info, call)
        if guard_fires(first_top_logprobs(answer), tau):
            info.guard_fired, info.report = True, None
            status, data = await self.up.post_json(COMPLETIONS, exact_ids)
            if status != 200:
                return self._upstream_failed(status, data, call)
            answer = _loads(data)
        self._spliced_done(fp, info, call)
        return json_reply(200, shaper.body(answer, info.done()), **headers)

    async def exact(self, req: FrontRequest, model: str, call: Call, why: Unplannable,
                    salt: str | None) -> Reply:
        """A request sent exactly as its own ids (a structured chat, a completion text with
        a registered skill): its part-wise ids to ``/v1/completions`` (the exact ``salt``, no
        splice salt), answered in the client's format; ``why`` in the reason header."""
        call.outcome, call.reason = Outcome.EXACT, why.code
        call.upstream_started()
        body = exact_body(req.prompt_ids, req, model)
        if salt is not None:
            body["cache_salt"] = salt
        info = UsageBuilder(exact=why.code)
        shaper = _shaper(req)
        headers = {REASON_HEADER: header_value(f"exact: {why.code}: {why}")}
        if req.stream:
            resp = await self._begin_stream(body, call)
            if isinstance(resp, Reply):
                return resp
            return Reply(200, {"content-type": "text/event-stream", "cache-control": "no-cache",
                               **headers},
                         stream=self._shaped([], _events(resp), shaper, info, None, call),
                         upstream=resp)
        status, data = await self.up.post_json(COMPLETIONS, body)
        if status != 200:
            return self._upstream_failed(status, data, call)
        return json_reply(200, shaper.body(_loads(data), info.done()), **headers)

    def _spliced_done(self, fp: FrontPlan | None, info: UsageBuilder, call: Call) -> None:
        if fp is None:  # an exact request sent by the front: its outcome stays
            return
        call.outcome = Outcome.GUARD_FIRED if info.guard_fired else Outcome.SPLICED
        plan = fp.plan
        self.metrics.spliced_tokens(plan.spliced_tokens, plan.repaired_tokens,
                                    plan.prompt_len - plan.spliced_tokens - plan.repaired_tokens,
                                    info.phases)

    def _upstream_failed(self, status: int, data: bytes, call: Call) -> Reply:
        call.outcome = Outcome.UPSTREAM_ERROR
        return Reply(status, {"content-type": JSON}, data)

    async def _begin_stream(self, body: UpstreamBody, call: Call) -> Any:
        resp = await self.up.open_stream("POST", COMPLETIONS, body)
        if resp.status_code != 200:
            try:
                data = await resp.aread()
            finally:
                await resp.aclose()
            return self._upstream_failed(resp.status_code, data, call)
        return resp

    async def _stream(self, req: FrontRequest, fp: FrontPlan, model: str, tau: float,
                      info: UsageBuilder, shaper: Shaper, headers: dict[str, str], call: Call,
                      exact_ids: UpstreamBody) -> Reply:
        resp = await self._begin_stream(real_body(fp, req, model, tau), call)
        if isinstance(resp, Reply):
            return resp
        events = _events(resp)
        held: list[Event] = []
        try:
            if tau > 0:
                # hold the stream until the first token's log-probs have come
                async for event in events:
                    held.append(event)
                    if _decides(event):
                        break  # [DONE], an error, the first token's log-probs, or the end
                top = next((t for t in map(first_top_logprobs,
                                           (e for e in held
                                            if isinstance(e, dict) and "error" not in e))
                            if t is not None), None)
                if guard_fires(top, tau):
                    await events.aclose()
                    info.guard_fired = True
                    resp = await self._begin_stream(exact_ids, call)
                    if isinstance(resp, Reply):
                        return resp
                    events, held = _events(resp), []
        except BaseException:
            await events.aclose()
            await resp.aclose()  # events may never have started: its own finally has not run
            raise
        return Reply(200, {"content-type": "text/event-stream", "cache-control": "no-cache",
                           **headers}, stream=self._shaped(held, events, shaper, info, fp, call),
                     upstream=resp)

    async def _shaped(self, held: list[Event], events: AsyncGenerator[Event, None],
                      shaper: Shaper, info: UsageBuilder, fp: FrontPlan | None, call: Call
                      ) -> AsyncGenerator[bytes, None]:
        """The client's events; a stream that breaks or sends what is not JSON ends with an
        error event and ``[DONE]``."""
        import httpx2

        failure = "the vLLM server's stream ended before [DONE]"
        try:
            async for event in _chain(held, events):
                if event is DONE:
                    self._spliced_done(fp, info, call)
                    yield DONE
                    return
                if isinstance(event, WrongEvent):
                    failure = f"the vLLM server sent an event that is not a completion chunk " \
                              f"({event})"
                    break
                if isinstance(event, InvalidEvent):
                    failure = "the vLLM server sent an event that is not JSON"
                    break
                if not isinstance(event, dict) or "error" in event:
                    call.outcome = Outcome.UPSTREAM_ERROR
                    yield sse(event)
                    continue
                for out in shaper.chunk(event, info.done()):
                    yield sse(out)
        except httpx2.HTTPError as err:
            failure = f"the vLLM server's stream broke: {type(err).__name__}"
        finally:
            await events.aclose()
        call.outcome = Outcome.UPSTREAM_ERROR
        yield sse(error_body(502, failure))
        yield DONE


def _shaper(req: FrontRequest) -> Shaper:
    return Shaper(req.kind, req.logprobs, req.include_usage, tools=req.tool_calls,
                  parallel=req.parallel_tool_calls)


def _decides(event: Event) -> bool:
    """Whether the guard can decide at ``event``: [DONE], what is not a chunk, the first
    token's log-probs, or the answer's end (an error event is passed on, and held)."""
    if not isinstance(event, dict):
        return True
    if "error" not in event:
        return first_top_logprobs(event) is not None \
            or any(c.get("finish_reason") for c in event.get("choices") or [])
    return False


def _report(params: object, call: Call) -> SpliceReport | None:
    """The connector's report in a completion answer's ``kv_transfer_params`` (None: it sent
    none; one this front cannot read is logged and left out, never passed on as if it were
    read)."""
    try:
        return SpliceReport.from_params(params)
    except ProtocolError as err:
        log.warning("request %s: the connector's report was refused: %s", call.id, err)
        return None


def _answer_report(answer: Completion, info: UsageBuilder, call: Call) -> None:
    """The connector's report of the answer, or why there is none: an answer that vLLM ended
    on a stop string (``stop_reason`` a string) has none, because vLLM's frontend aborts the
    request there and the engine's last output, which would carry it, is never sent. The text
    is vLLM's own either way: applying the stop strings here instead would cost generating up
    to ``max_tokens`` past the stop, and vLLM's matching (per new token, in the list's order,
    after ``min_tokens``) would have to be copied exactly."""
    params = answer.get("kv_transfer_params")
    info.report = _report(params, call)
    if info.report is not None:
        return
    if params is not None:
        info.no_report = "refused"
    elif any(isinstance(c.get("stop_reason"), str) for c in answer.get("choices") or []):
        info.no_report = "stop_string"


def _phase_report(data: bytes, call: Call) -> SpliceReport | None:
    """A phase answer's report (None: vLLM sent none, or one this front cannot read)."""
    try:
        answer = json.loads(data, parse_constant=no_constant)
    except (ValueError, RecursionError):
        return None
    return _report(answer.get("kv_transfer_params"), call) if isinstance(answer, dict) else None


async def _events(resp: Any) -> AsyncGenerator[Event, None]:
    """The events of an upstream SSE response (closing it when done or closed)."""
    try:
        async for line in resp.aiter_lines():
            event = _event(parse_sse_line(line))
            if event is not None:
                yield event
    finally:
        await resp.aclose()


def _event(data: JsonValue | bytes | InvalidEvent) -> Event | None:
    """One line's event (None: the line carries none)."""
    if isinstance(data, dict) and "error" not in data:
        try:
            return check_chunk(data)
        except WrongShape as err:
            return WrongEvent(str(err))
    if isinstance(data, dict):
        return cast(ErrorEvent, data)  # an object with an "error"
    if isinstance(data, (bytes, InvalidEvent)):  # DONE, or a payload that is not JSON
        return data
    if data is not None:
        return WrongEvent("an event that is not a JSON object")
    return None


async def _chain(held: list[Event], rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    for event in held:
        yield event
    async for event in rest:
        yield event


def _loads(data: bytes) -> Completion:
    try:
        out = json.loads(data, parse_constant=no_constant)
    except (ValueError, RecursionError) as err:
        raise ApiError(502, "the vLLM server answered with what is not JSON") from err
    try:
        return check_completion(out)
    except WrongShape as err:
        raise ApiError(502, f"the vLLM server's answer is not a completion ({err})") from err


class WrongEvent(InvalidEvent):
    """A streamed event that is JSON but not a completion chunk (``str``: what is wrong)."""
