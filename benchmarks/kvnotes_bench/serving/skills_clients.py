"""What the skills workload sends through: each policy's client straight to vLLM
(:class:`Clients`, planned by :class:`~kvnotes.serving.compose_client.ComposeClient`) or as text
to kvnotes' OpenAI front (:class:`FrontClients`), which plans the same phases and guard itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.core.repair import Repair
from kvnotes.serving.compose_client import ComposeClient, ComposeResult, cold_salt
from kvnotes.serving.json_types import CompletionBody
from kvnotes.serving.planning.phases import margin
from kvnotes_bench.serving.prompt_sets import AirlinePrompts, PromptSet
from kvnotes_bench.serving.skills_config import (
    DEFAULT_REPAIR_TOKENS,
    GUARDED_POLICIES,
    PHASED_POLICIES,
    SKILL_POLICIES,
    VARIANTS_POLICIES,
)
from kvnotes_bench.serving.skills_variants import VARIANTS_TENANT


class PolicyClients(Protocol):
    """What the benchmark sends through: ``send`` answers one prompt under a policy, ``plain``
    (vLLM itself) sends the exact references and the warm-up, ``tau`` is the guard's."""

    @property
    def plain(self) -> ComposeClient: ...

    @property
    def tau(self) -> float | None: ...

    def send(self, policy: str, parts: list[str], max_tokens: int, *,
             logprobs: int | None = None) -> ComposeResult: ...


@dataclass(frozen=True)
class Clients:
    """The benchmark's clients straight to vLLM: ``plain`` for cold/prefix/compose and the exact
    references, ``repaired`` and ``guarded`` for the phased policies (each its own tenant, so
    one phased policy's blocks never serve the other), and the guard's ``tau``."""

    plain: ComposeClient
    repaired: ComposeClient | None = None
    guarded: ComposeClient | None = None
    tau: float | None = None
    repair: Repair = Repair(first=DEFAULT_REPAIR_TOKENS)

    def send(self, policy: str, parts: list[str], max_tokens: int, *,
             logprobs: int | None = None) -> ComposeResult:
        if policy == "cold":
            return self.plain.complete(parts, max_tokens=max_tokens, salt=cold_salt(),
                                       logprobs=logprobs)
        if policy in ("prefix", "compose"):
            return self.plain.complete(parts, max_tokens=max_tokens, splice=policy == "compose",
                                       logprobs=logprobs)
        if policy in VARIANTS_POLICIES:
            raise InvalidArgumentError(f"the {policy} policy goes through kvnotes' OpenAI front "
                                       "(--via front)")
        client = self.repaired if policy == "repaired" else self.guarded
        if client is None:
            raise InvalidArgumentError(f"policy {policy!r} needs a phased client")
        return client.complete(parts, max_tokens=max_tokens, logprobs=logprobs,
                               repair=self.repair, guard=self.tau if policy == "guarded" else None)


@dataclass(frozen=True)
class FrontClients:
    """The policies sent as text to kvnotes' OpenAI front (``front``: a client of its URL),
    each spliced policy in its own tenant; the front finds the skills, plans the phases and
    runs the guard. ``plain`` talks to vLLM itself (the exact references). ``variants`` is
    ``repaired`` in the tenant the declared variants are published to
    (:data:`~kvnotes_bench.serving.skills_variants.VARIANTS_TENANT`): its requests see them
    beside the shared header-anchored skills, the other policies' never do.
    ``variants-guarded`` is ``variants`` with the guard (``tau``, as ``guarded``): the front's
    default when its library holds variants. The two variants policies share that tenant, so
    they share its blocks in vLLM's prefix cache: fidelity is unaffected (the same plan either
    way), but the TTFT rows of the one measured second can reuse blocks the first computed."""

    plain: ComposeClient
    front: ComposeClient
    tau: float | None = None
    repair: Repair = Repair(first=DEFAULT_REPAIR_TOKENS)

    def options(self, policy: str) -> dict[str, Any]:
        """The request's ``kvnotes`` options under ``policy`` (cold also sends its own salt,
        which the front forwards as it came)."""
        if policy in ("cold", "prefix"):
            return {"splice": False}
        if policy == "compose":
            return {"tenant": "compose", "repair": 0, "guard": 0}
        # a phased policy's name is its tenant; the variants policies' is where the variants are
        tenant = VARIANTS_TENANT if policy in VARIANTS_POLICIES else policy
        return {"tenant": tenant, "repair": self.repair.first,
                "guard": (self.tau or 0.0) if policy in GUARDED_POLICIES else 0}

    def send(self, policy: str, parts: list[str], max_tokens: int, *,
             logprobs: int | None = None) -> ComposeResult:
        if policy not in SKILL_POLICIES:
            raise UnknownNameError("policy", policy, SKILL_POLICIES)
        body: CompletionBody = {"model": self.front.model, "prompt": "".join(parts),
                                "max_tokens": int(max_tokens), "temperature": 0.0,
                                "kvnotes": self.options(policy)}
        if logprobs is not None:
            body["logprobs"] = int(logprobs)
        if policy == "cold":
            body["cache_salt"] = cold_salt()
        res = self.front.send(body)
        info = res.usage_kvnotes
        if info is not None:  # planned and spliced by the front (else forwarded exactly)
            res.phases = info.phases
            res.spliced_tokens = info.spliced_tokens
            res.guard_fired = info.guard_fired if policy in GUARDED_POLICIES else None
            res.plan = info.plan
        res.margin = margin(res.top_logprobs[0]) if res.top_logprobs else None
        return res


def make_clients(client: ComposeClient, policies: Sequence[str], block_size: int | None, *,
                 anchor: bool = True, tau: float | None = None,
                 prompt_set: PromptSet | None = None,
                 repair_tokens: int = DEFAULT_REPAIR_TOKENS) -> Clients:
    """``client`` and, for the phased policies, clients that plan with the server's block size
    (the library's pieces from ``client``'s skills folder when it has one, else the prompt
    set's own index)."""
    if not set(policies) & set(PHASED_POLICIES):
        return Clients(client)
    if block_size is None:
        raise InvalidArgumentError("the repaired and guarded policies need the server's block "
                                   "size: it reports none in /metrics (vllm:cache_config_info)")
    skills = client.store.folder if client.store is not None else (
        prompt_set or AirlinePrompts()).index(client.tokenizer, anchor=anchor)

    def phased(tenant: str) -> ComposeClient:
        return ComposeClient(client.url, client.model, client.tokenizer, timeout=client.timeout,
                             tenant=tenant, skills=skills, block_size=block_size)

    return Clients(client, repaired=phased("repaired"), guarded=phased("guarded"), tau=tau,
                   repair=Repair(first=repair_tokens))
