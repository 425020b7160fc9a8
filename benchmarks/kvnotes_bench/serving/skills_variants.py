"""The skills workload's declared variants: each skill compiled behind the header and the skill
that precedes it, for the (predecessor, skill) pairs the run's requests contain.

Before the measured requests, :func:`declare_variants` publishes those variants (as
``kvnotes skills add --after NAME`` does, ``ServingSkills.add(text, after=ids)``) in the
variants policy's tenant (:data:`VARIANTS_TENANT`), so only that policy's requests see them
beside the shared header-anchored skills. The front then splices, for each skill, the variant
:func:`kvnotes.core.variants.variant_rank` ranks first; the second skill of a request is exactly
placed behind the header and its predecessor, and not repaired. :class:`DeclaredVariants`
records what that cost: the entries compiled, their bytes on disk and the compile time (paid
once, amortized over the run), and their keys (what counts a plan's use of one as a hit).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvnotes.serving.skills import ServingSkills

VARIANTS_TENANT = "variants"  # the variants policy's tenant (its requests' own entries)


@dataclass(frozen=True)
class VariantPair:
    """One variant to declare: ``skill`` compiled behind ``header`` and ``predecessor``."""

    header: str
    predecessor: str
    skill: str


@dataclass(frozen=True)
class DeclaredVariants:
    """The variants a run declared: ``pairs`` (predecessor, skill) pairs over ``skills``
    distinct skills, ``compiled`` entries newly compiled (the rest were stored already),
    ``bytes`` on disk, ``compile_s`` spent publishing them (compiled once, amortized over the
    run), ``lead_tokens`` (BOS and the header: what every variant is compiled behind first),
    ``tenant`` and the entries' ``keys``."""

    pairs: int
    skills: int
    compiled: int
    bytes: int
    compile_s: float
    lead_tokens: int
    tenant: str = VARIANTS_TENANT
    keys: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "keys": list(self.keys)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeclaredVariants:
        return cls(pairs=int(d["pairs"]), skills=int(d["skills"]), compiled=int(d["compiled"]),
                   bytes=int(d["bytes"]), compile_s=float(d["compile_s"]),
                   lead_tokens=int(d["lead_tokens"]), tenant=str(d.get("tenant",
                                                                       VARIANTS_TENANT)),
                   keys=tuple(d.get("keys") or ()))


def variant_pairs(prompts: Iterable[Sequence[str]]) -> list[VariantPair]:
    """The distinct (predecessor, skill) pairs of ``prompts`` (each ``[header, *skills,
    question]``), in order of first use. A prompt's first skill has none: its header-anchored
    entry is already exactly placed.

    Example:
        >>> [(p.predecessor, p.skill) for p in variant_pairs([["H", "a", "b", "c", "q"],
        ...                                                    ["H", "a", "b", "q"]])]
        [('a', 'b'), ('b', 'c')]
    """
    seen: dict[VariantPair, None] = {}
    for parts in prompts:
        header, skills = parts[0], list(parts[1:-1])
        for pred, skill in zip(skills, skills[1:], strict=False):
            seen.setdefault(VariantPair(header, pred, skill), None)
    return list(seen)


def declare_variants(skills: ServingSkills, pairs: Sequence[VariantPair], *,
                     names: Mapping[str, str] | None = None, tenant: str = VARIANTS_TENANT,
                     log: Callable[[str], None] = lambda s: None) -> DeclaredVariants:
    """Publish each pair's skill compiled behind its header and predecessor (BOS per the
    library's anchor, then the header's ids and the predecessor's, each part encoded alone as
    a prompt lays them out) as ``tenant``'s entries; ``names``: a skill's name by its text.
    The library keeps every declared variant (its per-skill cap raised to the most
    predecessors any one skill has here)."""
    engine = skills.engine
    needed: dict[str, int] = {}
    for p in pairs:
        needed[p.skill] = needed.get(p.skill, 0) + 1
    library = copy.copy(skills)  # the same folder; only this copy's cap is raised
    library.max_variants = max([skills.max_variants, *needed.values()])
    leads: dict[str, list[int]] = {}
    keys: list[str] = []
    compiled = size = 0
    started = time.perf_counter()
    for p in pairs:
        lead = leads.setdefault(p.header, engine.anchor_ids(p.header,
                                                            anchor=skills.library.anchor))
        after = [*lead, *engine.encode(p.predecessor)]
        path = library.path_for(p.skill, after=after, tenant=tenant)
        compiled += not path.is_file()
        info = library.add(p.skill, name=(names or {}).get(p.skill, "skill"), after=after,
                           tenant=tenant)
        keys.append(info.key)
        size += library.entry_path(info.key).stat().st_size
    spent = time.perf_counter() - started
    declared = DeclaredVariants(pairs=len(pairs), skills=len(needed), compiled=compiled,
                                bytes=size, compile_s=round(spent, 3),
                                lead_tokens=max((len(v) for v in leads.values()), default=0),
                                tenant=tenant, keys=tuple(keys))
    log(f"declared {declared.pairs} skill variants (behind the header and the preceding skill) "
        f"of {declared.skills} skills: {declared.compiled} compiled, "
        f"{declared.bytes / 2**20:.1f} MiB")
    return declared


def variant_use(cases: Sequence[Mapping[str, Any]], keys: Iterable[str]) -> dict[str, int]:
    """What a fidelity row's plans spliced of the declared variants: ``spliced`` skills in
    all, ``hits`` of them from a declared variant, ``exact`` such hits spliced with nothing
    recomputed (exactly placed), and the ``repaired`` and ``prompt`` tokens summed (the share
    recomputed in context)."""
    declared = set(keys)
    out = {"spliced": 0, "hits": 0, "exact": 0, "repaired": 0, "prompt": 0}
    for c in cases:
        if "error" in c:
            continue
        out["repaired"] += int(c.get("repaired_tokens") or 0)
        out["prompt"] += int(c.get("prompt_tokens") or 0)
        for e in c.get("entries") or ():
            out["spliced"] += 1
            if e.get("key") in declared:
                out["hits"] += 1
                out["exact"] += not e.get("repaired")
    return out
