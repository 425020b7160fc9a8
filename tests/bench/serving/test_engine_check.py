"""The skills benchmark's engine check: the engine's answers to the fidelity prompts, and the
counts of the server's answers that equal them."""

from __future__ import annotations

import pytest

from kvnotes.ops.store import SkillLibrary
from kvnotes_bench.serving.engine_check import (
    EngineAnswer,
    check_against_engine,
    engine_answers,
    guarded_answers,
)
from kvnotes_bench.serving.prompt_sets import AirlinePrompts, BfclPrompts
from kvnotes_bench.serving.skills_fidelity import Fidelity
from kvnotes_bench.serving.skills_report import markdown

HEADER = "System: you answer customers of an airline.\n"
SKILLS = ("\nREFUNDS: unworn items within 30 days get their money back in full.",
          "\nBAGS: a damaged bag is repaired or paid for within 21 days of the flight.")


def test_engine_answers_use_the_stored_skills_and_full_repair_is_exact(tiny_llama, tmp_path):
    library = SkillLibrary(tmp_path, tiny_llama, anchor="none")
    for text in SKILLS:
        library.get(text, after=HEADER)
    stored = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    prompts = [[HEADER, *SKILLS, "\nCustomer: my bag is torn.\nAgent:"],
               [HEADER, SKILLS[1], SKILLS[0], "\nCustomer: refund?\nAgent:"]]
    lines: list[str] = []
    answers = engine_answers(tiny_llama, prompts, tmp_path, anchor=True, block_size=1,
                             repair_tokens=1000, tokens=6, log=lines.append)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == stored  # read, not made
    assert set(answers) == {"exact", "compose", "repaired"} and len(lines) == 2
    # every spliced token recomputed: the repaired answer is the full prefill's
    for exact, repaired in zip(answers["exact"], answers["repaired"], strict=True):
        assert repaired.text == exact.text and repaired.first_token == exact.first_token
        assert repaired.margin == pytest.approx(exact.margin, abs=1e-3) and exact.margin >= 0
    full = tiny_llama.greedy(tiny_llama.compose(prompts[0][:-1], repair=0), prompts[0][-1], 6)
    assert answers["exact"][0].text == full.text


def _fidelity(policy: str, spliced: list[str | None], exact: list[str],
              concurrency: int = 1) -> Fidelity:
    cases = [{"spliced": s, "exact": e} for s, e in zip(spliced, exact, strict=True)]
    return Fidelity(samples=len(cases), failed=0, first_token_agreement=None,
                    continuation_identity=None, continuation_tokens=4,
                    top20_overlap_mean=None, cases=cases, policy=policy,
                    concurrency=concurrency)


def test_check_counts_server_answers_equal_to_the_engine():
    a = EngineAnswer
    answers = {"exact": [a('get_a", "x', 1, 2.0), a('get_b", "y', 5, 0.1), a("z", 7, 3.0)],
               "compose": [a('get_a", "q', 1, 0.5), a('get_c"', 6, 0.2), a("z", 7, 3.0)],
               "repaired": [a('get_a", "x', 1, 1.5), a('get_c"', 6, 0.05), a("z", 7, 3.0)]}
    exact = ['get_a", "x', 'get_b", "y', "z"]
    fid = [_fidelity("compose", ['get_a", "q', 'get_c"', "w"], exact),
           _fidelity("repaired", ['get_a", "x', 'get_c"', None], exact),
           _fidelity("guarded", ['get_a", "x', 'get_b", "y', "z"], exact, concurrency=4)]
    bfcl = BfclPrompts(cases=[], header="", skills={})
    rows = {r.policy: r for r in check_against_engine(answers, fid, tau=0.3, prompt_set=bfcl)}
    compose, repaired, guarded = rows["compose"], rows["repaired"], rows["guarded"]
    assert (compose.server_equals_engine, compose.exact_equals_engine) == (2, 3)
    assert (compose.engine_first_token, compose.engine_continuation) == (2, 1)
    # "z" names no function: compared by its whole text
    assert (compose.engine_decision, compose.server_decision) == (2, 1)
    assert repaired.server_equals_engine == 2 and repaired.server_decision == 1  # one failed
    # the guard answers the second prompt (margin 0.05 < 0.3) from the engine's prefill
    assert guarded.guard_fires == 1 and guarded.concurrency == 4
    assert guarded.server_equals_engine == 3 and guarded.engine_continuation == 3
    assert guarded.engine_decision == 3
    airline = check_against_engine(answers, fid[:1], tau=None, prompt_set=AirlinePrompts())
    assert airline[0].engine_decision is None and airline[0].server_decision is None
    with pytest.raises(ValueError, match="2 fidelity cases for 3 prompts"):
        check_against_engine(answers, [_fidelity("compose", ["a", "b"], ["a", "b"])],
                             tau=None, prompt_set=bfcl)
    md = markdown({"config": {"model": "m", "requests": 1, "k": 4}, "machine": {},
                   "summaries": [], "ratios": [], "fidelity": [f.to_dict() for f in fid],
                   "engine_check": [r.to_dict() for r in rows.values()]})
    assert "Against kvnotes' engine" in md and "| guarded @ 4 | 3 | 3 | 3 | 3 | 3 | 3 | 1 |" in md


def test_variants_guarded_is_the_engines_variants_answer_unless_the_guard_fires():
    a = EngineAnswer
    answers = {"exact": [a('get_a", "x', 1, 2.0), a('get_b", "y', 5, 0.1), a("z", 7, 3.0)],
               # repaired would keep every answer (wide margins): only variants' margins count
               "repaired": [a('get_a", "q', 1, 9.0), a('get_c"', 6, 9.0), a("w", 8, 9.0)],
               "variants": [a('get_a", "x', 1, 1.5), a('get_c"', 6, 0.05), a("w", 8, 0.2)]}
    fired, mine = guarded_answers(answers["variants"], answers["exact"], 0.3)
    assert fired == [False, True, True]
    assert [m.text for m in mine] == ['get_a", "x', 'get_b", "y', "z"]
    assert guarded_answers(answers["variants"], answers["exact"], None)[0] == [False] * 3
    exact = ['get_a", "x', 'get_b", "y', "z"]
    fid = [_fidelity("variants", ['get_a", "x', 'get_c"', "w"], exact),
           _fidelity("variants-guarded", ['get_a", "x', 'get_b", "y', "z"], exact)]
    bfcl = BfclPrompts(cases=[], header="", skills={})
    rows = {r.policy: r for r in check_against_engine(answers, fid, tau=0.3, prompt_set=bfcl)}
    plain, guarded = rows["variants"], rows["variants-guarded"]
    assert plain.guard_fires is None and plain.server_equals_engine == 3
    assert plain.engine_continuation == 1
    assert guarded.guard_fires == 2 and guarded.server_equals_engine == 3
    assert guarded.engine_continuation == 3  # the fired two answered by the full prefill
    md = markdown({"config": {"model": "m", "requests": 1, "k": 4}, "machine": {},
                   "summaries": [], "ratios": [], "fidelity": [f.to_dict() for f in fid],
                   "engine_check": [r.to_dict() for r in rows.values()]})
    assert "| variants-guarded | 3 | 3 | 3 | 3 | 3 | 3 | 2 |" in md
