"""The server beside kvnotes' engine: the fidelity prompts composed in-process, compared.

A skills run's fidelity says how often the server's spliced answers equal the exact prompt's.
This check says whether the gap is the server's or the method's: each fidelity prompt is
composed by :meth:`Engine.compose` from the very notebooks the server splices (read from its
skill folder), bare (``compose``) or with the phased policies' repair aligned to the server's
block size (``repaired``; ``guarded`` answers from the engine's full prefill when the repaired
first token's top-2 margin is under the run's tau; ``variants``: ``repaired`` with the skill
folder as ``Engine.compose``'s library, so it swaps in the variants the run declared;
``variants-guarded``: ``variants``, from the full prefill when its margin is under tau), and
greedily continued for as many tokens.

Per spliced policy and concurrency level it counts the server's answers equal to the engine's
under the same policy and the server's exact answers equal to the engine's full prefill, and it
reports the engine's own agreement with its full prefill (first token, whole continuation and,
where the prompt set reads one, the decision): the figures the server is to reach.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import Repair
from kvnotes_bench.kit.records import Record
from kvnotes_bench.serving.prompt_sets import same_decision
from kvnotes_bench.serving.skills_config import GUARDED_POLICIES

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.core.notebook import Notebook
    from kvnotes_bench.serving.prompt_sets import PromptSet


@dataclass(frozen=True)
class EngineAnswer:
    """The engine's greedy answer to one prompt under one policy."""

    text: str
    first_token: int
    margin: float  # the first token's top-1 minus top-2 log-prob


@dataclass(frozen=True)
class EngineCheck(Record):
    """One spliced policy at one concurrency level against the engine (see the module doc)."""

    policy: str
    concurrency: int
    samples: int
    server_equals_engine: int  # the server's spliced answer is the engine's, token for token
    exact_equals_engine: int  # the server's exact answer is the engine's full prefill's
    engine_first_token: int  # the engine's own: first token equal to its full prefill's
    engine_continuation: int  # ... and the whole continuation
    engine_decision: int | None  # ... and the decision, where the prompt set reads one
    server_decision: int | None  # the server's decision equal to its exact answer's
    guard_fires: int | None = None  # guarded policies: prompts the engine answered exactly


def _answer(engine: Engine, nb: Notebook, query: str, tokens: int) -> EngineAnswer:
    gen = engine.greedy(nb, query, tokens)
    top = torch.log_softmax(gen.first_logits.float().flatten(), dim=-1).topk(2).values
    return EngineAnswer(gen.text, gen.token_ids[0], float(top[0] - top[1]))


def engine_answers(engine: Engine, prompts: Sequence[list[str]], skills_dir: Path, *,
                   anchor: bool, block_size: int, repair_tokens: int, tokens: int,
                   variants: bool = False,
                   log: Callable[[str], None] = print) -> dict[str, list[EngineAnswer]]:
    """Per prompt, the engine's answer as ``exact`` (every part prefilled), ``compose`` (the
    stored skills spliced bare) and ``repaired`` (their first ``repair_tokens`` recomputed in
    context, regions ending on a multiple of ``block_size``); with ``variants``, also
    ``variants``: ``repaired`` composed with the folder as its library
    (``Engine.compose(library=..., variants=True)``), so each skill is swapped for the stored
    variant that ranks first where it is placed, the declared ones included. Each prompt is
    ``[header, *skills, question]``, the layout the prompt sets publish."""
    from kvnotes.ops.store import SkillLibrary

    library = SkillLibrary(skills_dir, engine,
                           anchor="bos" if engine.bos_id is not None else "none")
    repairs = {"compose": Repair(first=0), "repaired": Repair(first=repair_tokens,
                                                                 align=block_size)}
    after = {p[0]: p[0] if anchor else None for p in prompts}
    missing = {t for p in prompts for t in p[1:-1]
               if not library.path_for(t, after=after[p[0]]).is_file()}
    if missing:
        raise InvalidArgumentError(
            f"{len(missing)} of the prompts' skills are not in {library.root} (the run's skill "
            f"folder for {engine.name}): the check reads the notebooks the server spliced, so "
            "give the run's --skills folder and its --model")
    loaded: dict[tuple[str, str], Notebook] = {}  # a skill read once, however many prompts use it

    def stored(text: str, header: str) -> Notebook:
        if (text, header) not in loaded:
            loaded[text, header] = library.get(text, after=after[header])
        return loaded[text, header]

    out: dict[str, list[EngineAnswer]] = {"exact": [], "compose": [], "repaired": []}
    if variants:
        out["variants"] = []
    for i, parts in enumerate(prompts):
        header, skills, query = parts[0], parts[1:-1], parts[-1]
        compiled = [stored(t, header) for t in skills]
        out["exact"].append(_answer(engine, engine.compose([header, *skills], repair=0), query,
                                    tokens))
        for policy, repair in repairs.items():
            nb = engine.compose([header, *compiled], repair=repair)
            out[policy].append(_answer(engine, nb, query, tokens))
        if variants:
            nb = engine.compose([header, *compiled], repair=repairs["repaired"],
                                library=library, variants=True)
            out["variants"].append(_answer(engine, nb, query, tokens))
        log(f"engine check: {i + 1}/{len(prompts)} prompts")
    return out


class FidelityRow(Protocol):
    """What the check reads of a fidelity row (``kvnotes_bench.serving.skills_fidelity.Fidelity``)."""

    policy: str
    concurrency: int
    cases: list[dict[str, Any]]


def check_against_engine(answers: dict[str, list[EngineAnswer]], fidelity: Sequence[FidelityRow],
                         *, tau: float | None, prompt_set: PromptSet) -> list[EngineCheck]:
    """Each fidelity row (one policy at one concurrency level, its cases in prompt order)
    against the engine's answers to the same prompts."""
    exact = answers["exact"]
    rows = []
    for f in fidelity:
        fired: list[bool] | None = None
        if f.policy in GUARDED_POLICIES:
            fired, mine = guarded_answers(answers[GUARDED_POLICIES[f.policy]], exact, tau)
        else:
            mine = answers[f.policy]
        cases = f.cases
        if len(cases) != len(mine):
            raise ValueError(f"{f.policy}: {len(cases)} fidelity cases for {len(mine)} prompts")
        trio = list(zip(cases, mine, exact, strict=True))
        decides = prompt_set.decides
        rows.append(EngineCheck(
            policy=f.policy, concurrency=f.concurrency, samples=len(cases),
            server_equals_engine=sum(c.get("spliced") == a.text for c, a, _ in trio),
            exact_equals_engine=sum(c.get("exact") == e.text for c, _, e in trio),
            engine_first_token=sum(a.first_token == e.first_token for _, a, e in trio),
            engine_continuation=sum(a.text == e.text for _, a, e in trio),
            engine_decision=(sum(same_decision(prompt_set, a.text, e.text) for _, a, e in trio)
                             if decides else None),
            server_decision=(sum(same_decision(prompt_set, c.get("spliced"), c.get("exact"))
                                 for c, _, _ in trio) if decides else None),
            guard_fires=None if fired is None else sum(fired)))
    return rows


def guarded_answers(unguarded: Sequence[EngineAnswer], exact: Sequence[EngineAnswer],
                    tau: float | None) -> tuple[list[bool], list[EngineAnswer]]:
    """A guarded policy's answers from the engine's: per prompt, whether the guard fired (the
    unguarded answer's first-token margin under ``tau``; None is off) and the answer, the
    full prefill's where it fired and the unguarded policy's otherwise."""
    fired = [a.margin < (tau or 0.0) for a in unguarded]
    return fired, [e if fire else a for e, a, fire in zip(exact, unguarded, fired, strict=True)]
