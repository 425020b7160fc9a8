"""The scheduler side of compiling by the server's own prefill: which request's blocks hold
which chunk, and when they are all computed.

A compile request carries a :class:`~kvnotes.serving.protocol.SaveRequest` (prompt tokens
``[start, end)`` to save as entry ``key``). :class:`SaveTracker` follows its blocks as the
scheduler hands them out (all of them at admission, prefix-cache hits included; more with each
chunk of a chunked prefill; a new set when it is resumed after preemption) and emits one
:class:`SaveSpec` in the step whose forward computes token ``end - 1``: the worker saves after
that forward (:mod:`kvnotes.serving.vllm.kv_saver`). A request aborted, or finished, before
that step emits nothing, so it leaves no entry. Nothing here imports vLLM; requests and the
scheduler's output are read by attribute.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvnotes.serving.library.splice import slot_mapping
from kvnotes.serving.protocol import SaveRequest

log = logging.getLogger("vllm.kvnotes")  # a child of vLLM's logger: its handler prints these


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Save prompt tokens ``[start, end)`` of request ``req_id`` (held in ``block_ids``) as
    entry ``key``: the chunk ``token_ids`` behind ``behind`` (the prompt before ``start``)."""

    req_id: str
    key: str
    name: str
    tenant: str | None
    behind: tuple[int, ...]
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    block_size: int

    @property
    def start(self) -> int:
        return len(self.behind)

    @property
    def end(self) -> int:
        return len(self.behind) + len(self.token_ids)

    def slots(self) -> torch.Tensor:
        """LongTensor[end - start]: the paged-cache slot of each saved token."""
        return slot_mapping(self.block_ids, self.block_size, self.start, self.end)


@dataclass
class _Tracked:
    message: SaveRequest
    prompt: tuple[int, ...]
    block_ids: list[int] = field(default_factory=list)
    emitted: bool = False


def save_request(request: Any) -> tuple[SaveRequest | None, str | None]:
    """``(message, None)``: the request's save request (None: it carries none); ``(None,
    why)`` when it carries one this connector cannot read or its range is not in the prompt."""
    from kvnotes.serving.protocol import ProtocolError

    try:
        message = SaveRequest.from_params(getattr(request, "kv_transfer_params", None))
    except ProtocolError as err:
        return None, str(err)
    prompt = getattr(request, "prompt_token_ids", None) or ()
    if message is not None and message.end > len(prompt):
        return None, (f"its range [{message.start}, {message.end}) is past the prompt's "
                      f"{len(prompt)} tokens")
    return message, None


class SaveTracker:
    """Compile requests by id, from admission to the step that completes their range.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> t = SaveTracker(block_size=4)
        >>> msg = SaveRequest("0" * 32, 2, 6, "doc")
        >>> t.track("r", msg, list(range(7)))
        >>> new = NS(req_id="r", block_ids=([5, 8],), num_computed_tokens=0)
        >>> out = NS(scheduled_new_reqs=[new], scheduled_cached_reqs=None,
        ...          num_scheduled_tokens={"r": 7})
        >>> [(s.key[:2], s.behind, s.token_ids, s.block_ids) for s in t.take(out)]
        [('00', (0, 1), (2, 3, 4, 5), (5, 8))]
    """

    def __init__(self, *, block_size: int) -> None:
        self.block_size = int(block_size)
        self._tracked: dict[str, _Tracked] = {}

    def track(self, req_id: str, message: SaveRequest, prompt: Sequence[int]) -> None:
        """Follow ``req_id`` (called at each admission: a resumed request keeps its entry)."""
        if req_id not in self._tracked:
            self._tracked[req_id] = _Tracked(message, tuple(int(t) for t in prompt))

    def take(self, scheduler_output: Any) -> list[SaveSpec]:
        """The saves whose range this step's forward completes, each once."""
        if not self._tracked:
            return []
        scheduled: Mapping[str, int] = scheduler_output.num_scheduled_tokens
        done: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs or ():
            t = self._tracked.get(new.req_id)
            if t is not None:
                t.block_ids = [int(b) for b in new.block_ids[0]]
                done[new.req_id] = int(new.num_computed_tokens)
        self._follow_cached(scheduler_output.scheduled_cached_reqs, done)
        specs = []
        for req_id, computed in done.items():
            t = self._tracked[req_id]
            if t.emitted or computed + int(scheduled.get(req_id, 0)) < t.message.end:
                continue
            t.emitted = True
            specs.append(self._spec(req_id, t))
        return specs

    def _follow_cached(self, cached: Any, done: dict[str, int]) -> None:
        """Blocks given to running and resumed requests this step (a resumed one's replace
        its old ones, which may belong to another request by now)."""
        if cached is None:
            return
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            got = [int(b) for b in new_ids[0]] if new_ids is not None else []
            t.block_ids = got if req_id in resumed else t.block_ids + got
            done[req_id] = int(cached.num_computed_tokens[i])

    def _spec(self, req_id: str, t: _Tracked) -> SaveSpec:
        m = t.message
        return SaveSpec(req_id, m.key, m.name, m.tenant, t.prompt[:m.start],
                        t.prompt[m.start:m.end], tuple(t.block_ids), self.block_size)

    def finished(self, req_id: str) -> bool:
        """Forget ``req_id``; True when its save was handed to the workers."""
        t = self._tracked.pop(req_id, None)
        if t is not None and not t.emitted:
            log.warning("kvnotes: compile request %s (entry %s) ended before its tokens "
                        "[%d, %d) were computed; nothing saved", req_id, t.message.key,
                        t.message.start, t.message.end)
        return t is not None and t.emitted

    def __len__(self) -> int:
        return len(self._tracked)
