"""The scheduler side of splicing: which requests get which pieces, written into which blocks.

vLLM asks its connector three things about a waiting request, in this order, every time the
request is admitted (a preempted request is admitted again, from zero computed tokens):

1. ``get_num_new_matched_tokens`` -> :meth:`SplicePlanner.match`: how many tokens past the
   local prefix-cache hit the pieces supply (a *plan*): the leading run of known pieces, or,
   when the request names splice ranges (a :class:`~kvnotes.serving.protocol.SpliceRequest`
   in its ``kv_transfer_params``), the ranges that hold the local hit, from the hit on;
2. ``update_state_after_alloc`` -> :meth:`SplicePlanner.allocated`: how many the scheduler took,
   and the request's blocks (a *load*, recorded here and nowhere later);
3. ``build_connector_meta`` -> :meth:`SplicePlanner.take`: the loads of every request scheduled
   this step, wherever the scheduler lists it (new requests; resumed ones, which the V1 model
   runner lists among the cached requests).

A load is emitted once: the connector loads synchronously before the forward of the step that
first schedules the request. What was done for a request (its local hit, its loads, the loads
that failed: :meth:`SplicePlanner.failed`, from vLLM's ``invalid_block_ids``) is kept until it
finishes, when :meth:`SplicePlanner.finished` gives it as a
:class:`~kvnotes.serving.protocol.SpliceReport`. Nothing here imports vLLM; requests are plain
values.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from kvnotes.serving.library.splice import (
    PieceIndex,
    Placement,
    check_ranges,
    external_tokens,
    leading_run,
    range_run,
    slot_mapping,
    visible,
)
from kvnotes.serving.protocol import LoadedRange, SpliceReport, SpliceRequest

log = logging.getLogger("vllm.kvnotes")  # a child of vLLM's logger: its handler prints these


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Tokens ``[start, end)`` of one request, supplied by ``run``, written into ``block_ids``.

    ``block_ids`` are all of the request's blocks (of its one KV cache group) at allocation;
    ``tenant`` is its splice request's (``None``: the shared entries only).
    """

    req_id: str
    tenant: str | None
    run: tuple[Placement, ...]
    start: int
    end: int
    block_ids: tuple[int, ...]
    block_size: int

    def slots(self) -> torch.Tensor:
        """LongTensor[end - start]: the paged-cache slot of each token written."""
        return slot_mapping(self.block_ids, self.block_size, self.start, self.end)

    @property
    def written_blocks(self) -> tuple[int, ...]:
        """The blocks this load writes into: the ones vLLM recomputes when it fails."""
        bs = self.block_size
        return self.block_ids[self.start // bs:-(-self.end // bs)]

    def pieces(self) -> list[Placement]:
        """The placements that overlap ``[start, end)`` (the local hit may cover the first)."""
        return [p for p in self.run if p.end > self.start and p.start < self.end]

    def loaded(self) -> list[LoadedRange]:
        """The tokens written, per entry."""
        return [LoadedRange(p.start, max(p.start, self.start), min(p.end, self.end), p.piece.key)
                for p in self.pieces()]

    def failed_from(self, blocks: Collection[int]) -> int | None:
        """The first token this load wrote into one of ``blocks`` (None: it wrote none)."""
        bs = self.block_size
        for i in range(self.start // bs, -(-self.end // bs)):
            if i < len(self.block_ids) and self.block_ids[i] in blocks:
                return max(self.start, i * bs)
        return None


@dataclass(frozen=True, slots=True)
class _Plan:
    tenant: str | None
    run: tuple[Placement, ...]
    start: int  # the block-aligned local hit vLLM asked with: the external run starts here


@dataclass
class _Done:
    """What was done for one request so far (every admission of it), for its report."""

    prompt_tokens: int
    local_hit: int
    refused: str | None = None
    loaded: dict[tuple[int, int, int, str], None] = field(default_factory=dict)  # ordered set
    failed: list[tuple[int, int]] = field(default_factory=list)
    # the latest load (its blocks are the request's until it finishes or is preempted; a
    # preempted request's old blocks may go to another request, so only the latest is matched)
    load: LoadSpec | None = None

    def report(self) -> SpliceReport:
        loaded = sorted((LoadedRange(*k) for k in self.loaded), key=lambda r: (r.start, r.end))
        return SpliceReport(self.prompt_tokens, self.local_hit, tuple(loaded),
                            tuple(sorted(set(self.failed))), self.refused)


class SplicePlanner:
    """Plans and loads by request id, as the scheduler's three calls hand them over.

    Example:
        >>> from kvnotes.serving.library.splice import PieceInfo
        >>> idx = PieceIndex(); idx.add(PieceInfo("k", "skill", tuple(range(40)), 0))
        >>> planner = SplicePlanner(block_size=16)
        >>> planner.match("r1", None, list(range(41)), 0, idx)
        40
        >>> planner.allocated("r1", [7, 3, 9], 40)
        >>> [(s.start, s.end, s.written_blocks) for s in planner.take({"r1": 41})]
        [(0, 40, (7, 3, 9))]
    """

    def __init__(self, *, block_size: int) -> None:
        self.block_size = int(block_size)
        self._plans: dict[str, _Plan] = {}
        self._pending: dict[str, LoadSpec] = {}
        self._warned: set[str] = set()  # requests whose dropped ranges were logged
        self._done: dict[str, _Done] = {}

    def match(self, req_id: str, tenant: str | None, tokens: Sequence[int],
              num_computed_tokens: int, index: PieceIndex,
              request: SpliceRequest | None = None, refused: str | None = None) -> int:
        """External tokens the pieces in ``index`` supply past ``num_computed_tokens``.

        ``request``: what the request asked (None, or one without ranges: the prompt's leading
        run of known pieces). With ranges, only tokens inside them are supplied: those of the
        range holding the local hit (and the ranges contiguous after it), from the hit on;
        nothing when no range holds it. The first range that does not hold the prompt's tokens
        (or whose entry, ``keys``, is not in ``index``) and every range after it are dropped,
        logged once per request. ``refused``: why the request's splice request could not be
        read, or its salt is not its tenant's: nothing is supplied (it is served exactly), and
        its report says why.

        Called again on every admission attempt: the latest answer is the plan.
        """
        done = self._done.setdefault(req_id, _Done(len(tokens), int(num_computed_tokens)))
        if refused is not None:
            if req_id not in self._warned:
                self._warned.add(req_id)
                log.warning("kvnotes: request %s: its splice request was refused (%s); nothing "
                            "is spliced, it is computed exactly", req_id, refused)
            done.refused = refused
            self._plans.pop(req_id, None)
            return 0
        end: int | None = None
        if request is None or request.ranges is None:
            run = leading_run(tokens, index)
        else:
            # the server checks each range itself: no client, the front included, is trusted
            checked = check_ranges(tokens, index, [r.to_list() for r in request.ranges],
                                   list(request.keys) if request.keys else None)
            if checked.reason is not None and req_id not in self._warned:
                self._warned.add(req_id)
                log.warning("kvnotes: request %s: %d of its splice ranges dropped (%s); their "
                            "tokens are computed", req_id, checked.dropped, checked.reason)
            run, end = range_run(checked, num_computed_tokens)
        # the index given is the tenant's view; this holds even for one that is not: a piece
        # of another tenant ends the run (its tokens are computed)
        shown = next((i for i, p in enumerate(run) if not visible(p.piece, tenant)), len(run))
        if shown < len(run):
            log.warning("kvnotes: request %s: piece %s belongs to another tenant; not spliced",
                        req_id, run[shown].piece.key)
            run = run[:shown]
            end = run[-1].end if run else num_computed_tokens
        ext = external_tokens(run, len(tokens), num_computed_tokens, end)
        if ext:
            self._plans[req_id] = _Plan(tenant, tuple(run), num_computed_tokens)
        else:
            self._plans.pop(req_id, None)
        return ext

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """The scheduler took ``num_external_tokens`` (it may take fewer than planned, or none)
        and gave the request ``block_ids``; the load starts where the plan's local hit ended."""
        plan = self._plans.pop(req_id, None)
        if plan is None or num_external_tokens <= 0:
            self._pending.pop(req_id, None)
            return
        end = plan.start + int(num_external_tokens)
        if not plan.run or end > plan.run[-1].end:
            raise AssertionError(f"request {req_id}: vLLM took tokens up to {end}, past the "
                                 f"planned run's end {plan.run[-1].end if plan.run else 0}")
        spec = LoadSpec(req_id, plan.tenant, plan.run, plan.start, end,
                        tuple(int(b) for b in block_ids), self.block_size)
        self._pending[req_id] = spec
        done = self._done.get(req_id)
        if done is not None:
            done.load = spec
            done.loaded.update(dict.fromkeys(
                (r.piece_start, r.start, r.end, r.key) for r in spec.loaded()))

    def take(self, scheduled: Collection[str]) -> list[LoadSpec]:
        """The loads of the requests in ``scheduled`` (ids of every request the step schedules:
        vLLM's ``num_scheduled_tokens``), each once; state for this step is cleared."""
        loads = [spec for req_id, spec in self._pending.items() if req_id in scheduled]
        dropped = [req_id for req_id in self._pending if req_id not in scheduled]
        if dropped:  # the sync contract schedules every allocated request in the same step
            log.warning("kvnotes: loads planned for requests %s that this step does not "
                        "schedule were dropped; they are planned again when admitted", dropped)
        self._pending.clear()
        self._plans.clear()  # plans not allocated this step are made again at the next admission
        return loads

    def failed(self, block_ids: Collection[int]) -> None:
        """Blocks whose load failed (vLLM's ``invalid_block_ids``): each request that wrote
        into them is recomputed by vLLM from the first one on, and its report says so."""
        blocks = set(int(b) for b in block_ids)
        if not blocks:
            return
        for done in self._done.values():
            start = None if done.load is None else done.load.failed_from(blocks)
            if done.load is not None and start is not None:
                done.failed.append((start, done.load.end))

    def finished(self, req_id: str) -> SpliceReport | None:
        """Forget the request; what was done for it (None: it was never matched, e.g. not a
        spliced request)."""
        self._warned.discard(req_id)
        self._plans.pop(req_id, None)
        self._pending.pop(req_id, None)
        done = self._done.pop(req_id, None)
        return None if done is None else done.report()

    @property
    def pending(self) -> int:
        return len(self._pending)
