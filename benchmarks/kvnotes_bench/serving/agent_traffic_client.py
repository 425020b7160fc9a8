"""``serve-bench agent``'s sender: chat completions through the workloads' client
(:mod:`kvnotes_bench.serving.client`) to kvnotes' front.

:class:`OpenAISender` sends an :class:`~kvnotes_bench.serving.agent_traffic_requests.AgentRequest`
as a chat completion, greedy (temperature 0), with the first tokens' log-probs (their token
strings compare two answers token by token), spliced (nothing added: what any client sends) or
exact (``extra_body={"kvnotes": {"splice": false}}``), whole or streamed (the time to the first
content or tool-call delta). :func:`answer_of` reads a response body into an :class:`Answer`
(pure: tested without a server); :class:`Sender` is what the protocols need of a client.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvnotes.serving.protocol import UsageKvnotes
from kvnotes_bench.kit.failures import classify
from kvnotes_bench.kit.records import Record
from kvnotes_bench.serving.agent_traffic_requests import AgentRequest
from kvnotes_bench.serving.client import get_json, open_client, stream

STATS_PATH = "/kvnotes/stats"  # the front's counters (kvnotes.serving.front.app)
_NAME_FIELD = re.compile(r'"name"\s*:\s*"([^"]+)"')
_CALL = re.compile(r"^\W*([A-Za-z_][\w.\-]*)\s*\(")


@dataclass
class Answer(Record):
    """One response, as the benchmark reads it.

    ``tokens`` are the answer's token strings from its log-probs (empty when the server sent
    none), ``margins`` each step's top-2 log-prob gap, ``tool`` the name of its first tool call
    (from ``tool_calls``, else read from its text: :func:`tool_choice`), ``kvnotes`` the
    ``usage.kvnotes`` object (None: the front reported none, e.g. a forwarded request),
    ``spliced_tokens`` its count (0 when absent).
    """

    ok: bool
    error: str | None = None
    error_kind: str | None = None  # one of kvnotes_bench.kit.failures.ERROR_KINDS
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    margins: list[float | None] = field(default_factory=list)
    tool: str | None = None
    tool_calls: int = 0
    prompt_tokens: int | None = None
    spliced_tokens: int = 0
    kvnotes: dict[str, Any] | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    finish_reason: str | None = None

    @property
    def first_token(self) -> str | None:
        return self.tokens[0] if self.tokens else None

    def usage(self) -> UsageKvnotes | None:
        """``kvnotes`` read as the front's message (None: none sent);
        :class:`~kvnotes.serving.protocol.ProtocolError` for one this version does not read."""
        return None if self.kvnotes is None else UsageKvnotes.from_dict(self.kvnotes)


def tool_choice(text: str, candidates: Sequence[str] = ()) -> str | None:
    """The tool an answer's text calls when the server sent no ``tool_calls``: the first
    ``"name": "..."`` field (a JSON call), else a leading ``name(`` (a Python-style call), else
    the candidate named earliest in the text; None when none is found.

    Example:
        >>> tool_choice('<tool_call>{"name": "get_weather", "arguments": {}}')
        'get_weather'
        >>> tool_choice("lookup(city='Paris')"), tool_choice("I will use b then a", ["a", "b"])
        ('lookup', 'b')
    """
    m = _NAME_FIELD.search(text)
    if m:
        return m.group(1)
    m = _CALL.match(text)
    if m:
        return m.group(1)
    found = [(text.find(c), c) for c in candidates if c and c in text]
    return min(found)[1] if found else None


def _steps(logprobs: Any) -> list[dict[str, Any]]:
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return [c for c in content or [] if isinstance(c, dict)]


def _tokens(logprobs: Any) -> list[str]:
    return [str(c.get("token")) for c in _steps(logprobs)]


def _margins(logprobs: Any) -> list[float | None]:
    """Per step, the top-1 minus top-2 log-probability (None: fewer than two sent)."""
    out: list[float | None] = []
    for c in _steps(logprobs):
        top = sorted((float(t.get("logprob") or 0.0) for t in c.get("top_logprobs") or []
                      if isinstance(t, dict) and t.get("logprob") is not None), reverse=True)
        out.append(top[0] - top[1] if len(top) >= 2 else None)
    return out


def answer_of(body: Mapping[str, Any], candidates: Sequence[str] = ()) -> Answer:
    """A whole chat completion body (``ChatCompletion.model_dump()``) as an :class:`Answer`."""
    choices = body.get("choices") or []
    if not choices:
        return Answer(ok=False, error="no choices in the response")
    choice = choices[0]
    message = choice.get("message") or {}
    text = message.get("content") or ""
    calls = message.get("tool_calls") or []
    tool = None
    if calls:
        fn = (calls[0] or {}).get("function") or {}
        tool = fn.get("name")
    if tool is None:
        # a call's arguments are part of the answer too: compare what the model wrote
        tool = tool_choice(text, candidates)
    if calls and not text:
        text = json.dumps([c.get("function") for c in calls], sort_keys=True)
    usage = body.get("usage") or {}
    info = usage.get("kvnotes") if isinstance(usage.get("kvnotes"), dict) else None
    return Answer(ok=True, text=text, tokens=_tokens(choice.get("logprobs")),
                  margins=_margins(choice.get("logprobs")), tool=tool,
                  tool_calls=len(calls), prompt_tokens=usage.get("prompt_tokens"),
                  spliced_tokens=int((info or {}).get("spliced_tokens") or 0), kvnotes=info,
                  finish_reason=choice.get("finish_reason"))


class Sender(Protocol):
    """What the benchmark's protocols need of a client."""

    async def send(self, request: AgentRequest, *, splice: bool, max_tokens: int) -> Answer:
        """The whole greedy answer (with its tokens' log-probs)."""
        ...

    async def stream(self, request: AgentRequest, *, splice: bool, max_tokens: int) -> Answer:
        """A streamed greedy answer with its time to first token."""
        ...


class LearningSender(Sender, Protocol):
    """A :class:`Sender` that also reads the front's learner and names a request's repair
    (what the fidelity protocol needs)."""

    async def send(self, request: AgentRequest, *, splice: bool, max_tokens: int,
                   repair: int | None = None) -> Answer:
        """As :meth:`Sender.send`; ``repair``: ``kvnotes.repair`` (the first tokens of each
        spliced chunk recomputed; None: the front's own repair)."""
        ...

    async def learner(self) -> dict[str, int] | None:
        """The front's learner counters (``/kvnotes/stats``' ``learner``: ``compiles``,
        ``failures``, ...); None when the front has no learner or does not answer."""
        ...


def extra_body(splice: bool, tenant: str | None, repair: int | None = None
               ) -> dict[str, Any] | None:
    """The ``kvnotes`` options of a request: nothing for a spliced one in the default tenant
    with the front's repair (what an ordinary client sends), ``splice: false`` for the exact
    twin, ``repair: K`` for a request that names its repair.

    Example:
        >>> extra_body(True, None), extra_body(False, "acme"), extra_body(True, None, 8)
        (None, {'kvnotes': {'splice': False, 'tenant': 'acme'}}, {'kvnotes': {'repair': 8}})
    """
    opts: dict[str, Any] = {}
    if not splice:
        opts["splice"] = False
    if tenant is not None:
        opts["tenant"] = tenant
    if repair is not None:
        opts["repair"] = repair
    return {"kvnotes": opts} if opts else None


class OpenAISender:
    """:class:`Sender` over the workloads' client (:func:`~kvnotes_bench.serving.client.
    open_client`: one ``AsyncOpenAI``, its own connection pool).

    Args:
        url: the front's URL (``http://127.0.0.1:PORT``).
        model: the served model name.
        timeout: seconds one request may take.
        tenant: sent as ``kvnotes.tenant`` (None: the front's default tenant).
        api_key: the key the front checks (any string when it checks none).
    """

    def __init__(self, url: str, model: str, *, timeout: float = 600.0,
                 tenant: str | None = None, api_key: str = "kvnotes") -> None:
        self.model, self.tenant, self.url = model, tenant, url.rstrip("/")
        self.client = open_client(url, timeout=timeout, api_key=api_key)

    def _args(self, request: AgentRequest, splice: bool, max_tokens: int,
              repair: int | None = None) -> dict[str, Any]:
        args: dict[str, Any] = {"model": self.model, "messages": request.messages(),
                                "temperature": 0, "max_tokens": max_tokens, "logprobs": True,
                                "top_logprobs": 2}
        tools = request.tools()
        if tools is not None:
            args["tools"] = tools
        body = extra_body(splice, self.tenant, repair)
        if body is not None:
            args["extra_body"] = body
        return args

    async def send(self, request: AgentRequest, *, splice: bool, max_tokens: int,
                   repair: int | None = None) -> Answer:
        args = self._args(request, splice, max_tokens, repair)  # a bad request raises here
        t0 = time.perf_counter()
        try:
            resp = await self.client.chat.completions.create(**args)
        except Exception as err:  # noqa: BLE001 -- every server failure is an outcome
            failure = classify(err)
            return Answer(ok=False, error=failure.message, error_kind=failure.kind)
        answer = answer_of(resp.model_dump(), request.candidates)
        answer.total_s = time.perf_counter() - t0
        return answer

    async def stream(self, request: AgentRequest, *, splice: bool, max_tokens: int) -> Answer:
        args = self._args(request, splice, max_tokens)  # a bad request raises here
        reader = _DeltaReader()
        seen = await stream(
            lambda: self.client.chat.completions.create(
                **args, stream=True, stream_options={"include_usage": True}),
            reader)
        if seen.failure is not None:
            return Answer(ok=False, error=seen.failure.message, error_kind=seen.failure.kind,
                          ttft_s=seen.ttft_s)
        info = reader.usage.get("kvnotes")
        info = info if isinstance(info, dict) else None
        joined = "".join(reader.text)
        return Answer(ok=True, text=joined, tokens=reader.tokens, margins=reader.margins,
                      tool=reader.tool or tool_choice(joined, request.candidates),
                      prompt_tokens=reader.usage.get("prompt_tokens"),
                      spliced_tokens=int((info or {}).get("spliced_tokens") or 0), kvnotes=info,
                      ttft_s=seen.ttft_s, total_s=seen.total_s)

    async def learner(self) -> dict[str, int] | None:
        """The front's learner counters, from ``GET /kvnotes/stats`` (sent with the key the
        requests use: a front with ``--api-key`` checks it there too)."""
        stats = await get_json(self.client, self.url + STATS_PATH)
        counters = stats.get("learner") if isinstance(stats, dict) else None
        if not isinstance(counters, dict):
            return None
        return {str(k): int(v) for k, v in counters.items() if isinstance(v, int)}

    async def close(self) -> None:
        await self.client.close()


@dataclass
class _DeltaReader:
    """Folds streamed chat chunks: text, tool name, token strings and margins, usage."""

    text: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    margins: list[float | None] = field(default_factory=list)
    tool: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)

    def __call__(self, chunk: Any, _t: float) -> bool:
        """True when ``chunk`` carried content or a tool call (the first token's time)."""
        data = chunk.model_dump()
        self.usage = data.get("usage") or self.usage
        carried = False
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            carried = carried or bool(delta.get("content") or delta.get("tool_calls"))
            self.text.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                self.tool = self.tool or ((call or {}).get("function") or {}).get("name")
            self.tokens += _tokens(choice.get("logprobs"))
            self.margins += _margins(choice.get("logprobs"))
        return carried
