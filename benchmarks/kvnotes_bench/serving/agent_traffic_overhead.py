"""What learning costs a request that gets nothing from it: ``serve-bench agent``'s timings.

Two measurements, streamed (the time to the first content or tool-call delta), medians over
``repeats`` pairs sent one after the other in alternating order (neither arm always runs
first):

- ``miss``: a request seen for the first time (the front counts its chunks, nothing is
  spliced) against a request of the same shape with ``splice: false`` (forwarded exactly).
  Each request is a :meth:`~.agent_traffic_requests.AgentRequest.variant` of a base request
  with a tag of its own, so neither arm finds its chunks in vLLM's prefix cache or the library.
- ``compile``: a probe request sent right after a request whose chunks are seen for the second
  time (their compile starts in the background) against a probe sent right after a request
  seen for the first time (nothing compiles). Both probes are fresh variants.

The goal (issue: at most 5% over the exact twin / over no compile) reads ``overhead``:
median of the measured arm over the reference arm's, minus one. Timings are only meaningful
on an otherwise idle machine: each :class:`Timing` records the load average around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvnotes_bench.kit.machine import load_now
from kvnotes_bench.kit.records import Record
from kvnotes_bench.kit.stats import median
from kvnotes_bench.serving.agent_traffic_client import Sender
from kvnotes_bench.serving.agent_traffic_requests import AgentRequest

OVERHEAD_GOAL = 0.05


@dataclass
class Timing(Record):
    """One measurement's TTFTs per arm (``measured`` against ``reference``)."""

    name: str  # "miss" or "compile"
    measured: list[float | None] = field(default_factory=list)
    reference: list[float | None] = field(default_factory=list)
    failed: int = 0
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)

    @staticmethod
    def _median(xs: Sequence[float | None]) -> float | None:
        return median(x for x in xs if x is not None)

    @property
    def median_measured_s(self) -> float | None:
        return self._median(self.measured)

    @property
    def median_reference_s(self) -> float | None:
        return self._median(self.reference)

    @property
    def overhead(self) -> float | None:
        """Median measured TTFT over median reference TTFT, minus one."""
        m, r = self.median_measured_s, self.median_reference_s
        return m / r - 1 if m is not None and r else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        ov = self.overhead
        out.update(median_measured_s=self.median_measured_s,
                   median_reference_s=self.median_reference_s, overhead=ov,
                   goal_met=None if ov is None else ov <= OVERHEAD_GOAL)
        return out


async def _ttft(sender: Sender, request: AgentRequest, splice: bool, max_tokens: int,
                timing: Timing) -> float | None:
    answer = await sender.stream(request, splice=splice, max_tokens=max_tokens)
    if not answer.ok or answer.ttft_s is None:
        timing.failed += 1
        return None
    return answer.ttft_s


async def miss_overhead(sender: Sender, bases: Sequence[AgentRequest], repeats: int, *,
                        max_tokens: int = 4, tag: str = "m",
                        log: Callable[[str], None] = lambda s: None) -> Timing:
    """First sight against ``splice: false``, ``repeats`` pairs over ``bases`` in turn."""
    timing = Timing("miss", load_before=load_now())
    for i in range(repeats):
        base = bases[i % len(bases)]
        first = base.variant(f"{tag}{i}a")
        twin = base.variant(f"{tag}{i}b")
        arms = [(True, first), (False, twin)]
        for splice, req in arms if i % 2 == 0 else arms[::-1]:
            t = await _ttft(sender, req, splice, max_tokens, timing)
            (timing.measured if splice else timing.reference).append(t)
    timing.load_after = load_now()
    log(f"  miss: median TTFT first sight {timing.median_measured_s}, splice:false "
        f"{timing.median_reference_s} (overhead {timing.overhead})")
    return timing


async def compile_overhead(sender: Sender, bases: Sequence[AgentRequest], repeats: int, *,
                           sightings: int = 2, max_tokens: int = 4, tag: str = "c",
                           log: Callable[[str], None] = lambda s: None) -> Timing:
    """A probe right after a request that starts a compile (its ``sightings``-th sight)
    against a probe right after one that does not (its first)."""
    timing = Timing("compile", load_before=load_now())
    for i in range(repeats):
        base = bases[i % len(bases)]
        for arm in ((True, False) if i % 2 == 0 else (False, True)):
            trigger = base.variant(f"{tag}{i}{'t' if arm else 'n'}")
            # the compiling arm's trigger was seen before; the other's is new (same count of
            # requests in both arms: the other arm's earlier sightings go to an unrelated one)
            earlier = trigger if arm else base.variant(f"{tag}{i}u")
            for _ in range(sightings - 1):
                await sender.send(earlier, splice=True, max_tokens=1)
            await sender.send(trigger, splice=True, max_tokens=1)
            probe = bases[(i + 1) % len(bases)].variant(f"{tag}{i}{'p' if arm else 'q'}")
            t = await _ttft(sender, probe, True, max_tokens, timing)
            (timing.measured if arm else timing.reference).append(t)
    timing.load_after = load_now()
    log(f"  compile: median probe TTFT beside a compile {timing.median_measured_s}, without "
        f"{timing.median_reference_s} (overhead {timing.overhead})")
    return timing
