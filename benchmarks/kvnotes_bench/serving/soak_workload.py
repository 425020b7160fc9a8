"""What the soak sends: its configuration (:class:`SoakConfig`), the user turns and library
skills requests draw from, the volatile skills' texts, and each client's next request
(:func:`next_spec`: its kind, prompt, tenant and whether it disconnects)."""

from __future__ import annotations

import dataclasses
import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes_bench.serving.soak_check import KINDS, SHARED_TENANTS, Prompt, SkillEvent, event_schedule

if TYPE_CHECKING:
    from kvnotes.serving.launch.launcher import LaunchConfig
    from kvnotes.serving.protocol import SpliceRequest


# short user turns: every reference is computed by the engine, and a distinct prompt costs its
# user text and the answer's steps (the skills before it are spliced or shared prefixes)
USERS = ("\n\nCustomer: my bag arrived torn. What do I get?\nAgent:",
         "\n\nCustomer: can I cancel my flight tomorrow and get my money back?\nAgent:",
         "\n\nCustomer: my flight was six hours late. What am I owed?\nAgent:",
         "\n\nCustomer: I am a gold member; can I change my booking for free?\nAgent:",
         "\n\nCustomer: I missed my connection. What happens now?\nAgent:",
         "\n\nCustomer: can I add a second bag after check-in?\nAgent:")
SOAK_SKILLS = ("baggage", "cancellation", "compensation", "refunds")
_NOTICES = ("a strike at the destination airport", "a runway closure", "a storm warning",
            "a check-in system outage", "a fuel shortage", "an air-traffic control strike")


def volatile_text(i: int) -> str:
    """The ``i``-th volatile skill: a short notice no other skill shares a token run with."""
    notice = _NOTICES[i % len(_NOTICES)]
    return (f"## Temporary notice {i}\n\nBecause of {notice} (notice {i}), passengers booked "
            f"on affected flights may rebook once without a change fee within {24 + i} hours; "
            "refunds follow the refund policy.\n\n")


@dataclass(frozen=True)
class SoakConfig:
    """What one soak runs.

    Args:
        duration_s: seconds clients keep sending (a request in flight at the end finishes).
        clients: concurrent clients (each sends its next request when its last one ends).
        max_tokens: greedy tokens per answer (every one is checked).
        skills: the library skills requests draw from (a few: each distinct prompt costs a
            reference computed by the engine).
        k_min, k_max: skills per request, drawn uniformly.
        users: how many of the short user turns (:data:`USERS`) requests draw from.
        exact_fraction: requests sent exactly (no salt).
        volatile_fraction: requests that carry the volatile skill of the moment (when one is
            live; spliced otherwise).
        disconnect_fraction: requests whose stream the client closes after 1-3 chunks.
        event_interval_s, damage_after_s, retire_after_s, first_event_s: the skill events
            (:func:`~kvnotes_bench.serving.soak_check.event_schedule`).
        block_size: the server's KV block size (tokens; CPU: a multiple of 32).
        kv_blocks: the server's KV cache in blocks (``--num-gpu-blocks-override``): small, so
            vLLM preempts.
        max_model_len: the server's longest prompt plus answer.
        tie_tau: server log-probability gap under which a divergence is a near tie.
        seed: the workload's random seed.
    """

    model: str = "smollm2-135m"
    duration_s: float = 180.0
    clients: int = 8
    max_tokens: int = 16
    skills: tuple[str, ...] = SOAK_SKILLS
    k_min: int = 1
    k_max: int = 2
    users: int = 4
    exact_fraction: float = 0.2
    volatile_fraction: float = 0.3
    disconnect_fraction: float = 0.1
    event_interval_s: float = 20.0
    damage_after_s: float = 8.0
    retire_after_s: float = 16.0
    first_event_s: float = 5.0
    block_size: int = 32
    kv_blocks: int = 96
    max_model_len: int = 2048
    tie_tau: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        from kvnotes_bench.serving.prompt_sets import skill_texts

        library = skill_texts()
        unknown = [name for name in self.skills if name not in library]
        if unknown:
            raise UnknownNameError("skill", unknown[0], sorted(library))
        if self.duration_s <= 0:
            raise InvalidArgumentError(f"--duration must be positive, got {self.duration_s}")
        if self.clients < 1:
            raise InvalidArgumentError(f"--clients must be at least 1, got {self.clients}")
        if not 1 <= self.max_tokens <= 256:
            raise InvalidArgumentError(f"--max-tokens must be 1-256 (every answer is checked "
                                       f"against the engine), got {self.max_tokens}")
        if not 1 <= self.k_min <= self.k_max <= len(self.skills):
            raise InvalidArgumentError(f"skills per request: need 1 <= k_min ({self.k_min}) <= "
                                       f"k_max ({self.k_max}) <= {len(self.skills)} (the skills "
                                       "drawn from)")
        if not 1 <= self.users <= len(USERS):
            raise InvalidArgumentError(f"users must be 1-{len(USERS)}, got {self.users}")
        for name in ("exact_fraction", "volatile_fraction", "disconnect_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise InvalidArgumentError(f"{name} must lie in [0, 1], got {value}")
        if self.exact_fraction + self.volatile_fraction > 1.0:
            raise InvalidArgumentError("exact_fraction + volatile_fraction must be at most 1")
        if self.block_size <= 0 or self.block_size % 32:
            raise InvalidArgumentError(f"--block-size {self.block_size}: vLLM's CPU build "
                                       "takes a positive multiple of 32")
        if self.kv_blocks * self.block_size < self.max_model_len:
            raise InvalidArgumentError(
                f"--kv-blocks {self.kv_blocks} x block size {self.block_size} holds fewer "
                f"tokens than max_model_len {self.max_model_len}: vLLM refuses to start")
        if self.tie_tau < 0:
            raise InvalidArgumentError(f"tie_tau must be 0 or more, got {self.tie_tau}")
        self.events()  # refuses an event timing that does not fit

    def events(self) -> list[SkillEvent]:
        return event_schedule(self.duration_s, interval_s=self.event_interval_s,
                              damage_after_s=self.damage_after_s,
                              retire_after_s=self.retire_after_s, first_s=self.first_event_s)

    def launch(self, base: LaunchConfig, skills: Path) -> LaunchConfig:
        """``base`` with this soak's cache, block size, length and skill folder."""
        return dataclasses.replace(
            base, skills=skills, block_size=self.block_size, max_model_len=self.max_model_len,
            kv_cache_gib=1, extra_args=(*base.extra_args, "--num-gpu-blocks-override",
                                        str(self.kv_blocks)))


# ---- requests --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestSpec:
    """One request a client sends: its kind, prompt, tenant and whether it disconnects."""

    kind: str
    prompt: Prompt
    tenant: str | None
    close_after: int | None = None
    volatile: int | None = None  # the volatile skill's index

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"request kind {self.kind!r}: use one of "
                                       f"{', '.join(KINDS)}")


def next_spec(rng: random.Random, config: SoakConfig, live: int | None) -> RequestSpec:
    """The next request of a client; ``live`` is the volatile skill of the moment (None: none).

    A spliced request carries ``k_min``-``k_max`` library skills, an exact one a single skill.
    A volatile request is ``[header][one library skill][the volatile skill][user]``: the
    volatile skill is moved (it was compiled right behind the header), so its splice differs
    from an exact prefill, and it is last, so the run cut at it leaves little to compute.
    """
    r = rng.random()
    kind = ("exact" if r < config.exact_fraction else
            "volatile" if live is not None and r < config.exact_fraction + config.volatile_fraction
            else "spliced")
    # exact and volatile requests carry one library skill: their exact references share the
    # prefill of header + skill (the engine computes each once)
    n = rng.randint(config.k_min, config.k_max) if kind == "spliced" else 1
    names = rng.sample(list(config.skills), n)
    at = None
    if kind == "volatile":
        at = len(names)
        names.append(volatile_name(live))  # type: ignore[arg-type]
    close = rng.randint(1, 3) if rng.random() < config.disconnect_fraction else None
    tenant = (f"soak-v{live}-{uuid.uuid4().hex[:12]}" if kind == "volatile"
              else rng.choice(SHARED_TENANTS) if kind == "spliced" else None)
    user = USERS[rng.randrange(min(config.users, len(USERS)))]
    return RequestSpec(kind, Prompt(tuple(names), user, config.max_tokens, at), tenant, close,
                       live if kind == "volatile" else None)


def volatile_name(i: int) -> str:
    return f"volatile-{i}"


def splice_of(spec: RequestSpec) -> SpliceRequest | None:
    """What a spliced request of the soak carries: its tenant's leading run of skills."""
    from kvnotes.serving.protocol import SpliceRequest

    return None if spec.kind == "exact" else SpliceRequest.leading(spec.tenant)
