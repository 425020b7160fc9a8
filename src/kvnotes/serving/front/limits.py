"""The bounds on one request's work: what a body may hold, how long and how many of one
client's requests may plan at once.

- :func:`check_bounds`, at the door: at most ``max_tools`` tools, each nested at most
  ``max_tool_depth`` deep, ``max_messages`` messages, ``max_content_parts`` content parts in
  all (400 naming the field), a prompt of token ids of at most ``max_prompt_tokens`` (413).
  These bound a request's planning and its memory by a small multiple of its body.
- :class:`PlanDeadline`: a plan stops (:class:`PlanStopped`) once it has run ``plan_timeout``
  seconds or its client has left; :class:`DeadlineTokenizer` checks it at every call to the
  tokenizer and at every part the layout reads (its ids cached or not), so a thread stops
  within one part.
- :class:`PlanTurns`: at most ``max_plans_per_client`` plans of one client (its key, or its
  address without keys) wait for or hold a planning thread; its other requests wait their turn
  behind them, so one client never occupies every planning thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from kvnotes.serving.front.config import FrontConfig
from kvnotes.serving.front.errors import ApiError
from kvnotes.serving.json_types import RequestBody


def check_bounds(kind: str, body: RequestBody, config: FrontConfig) -> None:
    """Refuse a body beyond the front's bounds (400 naming the field, 413 for a prompt of
    token ids longer than ``max_prompt_tokens``)."""
    c = config
    if kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and len(prompt) > c.max_prompt_tokens:
            raise ApiError(413, f"the prompt has {len(prompt)} tokens, more than "
                           f"{c.max_prompt_tokens} (FrontConfig.max_prompt_tokens)", "prompt")
        return
    tools = body.get("tools")
    if isinstance(tools, list):
        if len(tools) > c.max_tools:
            raise ApiError(400, f"{len(tools)} tools, more than {c.max_tools} "
                           "(FrontConfig.max_tools)", "tools")
        for i, tool in enumerate(tools):
            if _depth(tool) > c.max_tool_depth:
                raise ApiError(400, f"tools[{i}] is nested deeper than {c.max_tool_depth} "
                               "levels (FrontConfig.max_tool_depth)", f"tools[{i}]")
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    if len(messages) > c.max_messages:
        raise ApiError(400, f"{len(messages)} messages, more than {c.max_messages} "
                       "(FrontConfig.max_messages)", "messages")
    parts = 0
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts += len(content)
            if parts > c.max_content_parts:
                raise ApiError(400, f"more than {c.max_content_parts} content parts "
                               "(FrontConfig.max_content_parts)", f"messages[{i}].content")


def _depth(value: object) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                  else item))
    return deepest


class PlanStopped(Exception):
    """A plan ran past its deadline, or its client left."""


class PlanDeadline:
    """When a plan stops: ``seconds`` after :meth:`start`, or at :meth:`cancel`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at = float("inf")
        self._cancelled = threading.Event()

    def start(self) -> None:
        self._at = time.monotonic() + self.seconds

    def cancel(self) -> None:
        self._cancelled.set()

    def check(self) -> None:
        if self._cancelled.is_set():
            raise PlanStopped("its client left")
        if time.monotonic() > self._at:
            raise PlanStopped(f"it took longer than {self.seconds:g} s")


class DeadlineTokenizer:
    """A tokenizer whose every call first checks a :class:`PlanDeadline` (attributes pass
    through unchanged)."""

    __slots__ = ("_deadline", "_tokenizer")

    def __init__(self, tokenizer: Any, deadline: PlanDeadline) -> None:
        self._tokenizer, self._deadline = tokenizer, deadline

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._deadline.check()
        return self._tokenizer(*args, **kwargs)

    def check_deadline(self) -> None:
        """Stop here if the plan's time is up: called per part by the layout, so a plan whose
        parts' ids are all cached (no tokenizer call) stops within one part too."""
        self._deadline.check()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._tokenizer, name)
        if not callable(value) or isinstance(value, type):
            return value
        deadline = self._deadline

        def checked(*args: Any, **kwargs: Any) -> Any:
            deadline.check()
            return value(*args, **kwargs)

        return checked


class PlanTurns:
    """At most ``per_client`` plans of one client at once (waiting for a planning thread or
    on one); ``async with turns.turn(client):`` waits for one. Memory: one entry per client
    with a request planning, dropped with its last."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self._clients: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}

    def planning(self, client: str) -> int:
        """The plans of ``client`` waiting for their turn or holding one."""
        entry = self._clients.get(client)
        return 0 if entry is None else entry[1][0]

    @contextlib.asynccontextmanager
    async def turn(self, client: str) -> AsyncIterator[None]:
        entry = self._clients.get(client)
        if entry is None:
            entry = self._clients[client] = (asyncio.Semaphore(self.per_client), [0])
        sem, users = entry
        users[0] += 1
        try:
            async with sem:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                self._clients.pop(client, None)
