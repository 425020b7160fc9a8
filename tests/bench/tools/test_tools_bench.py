"""The BFCL tool-choice benchmark: data loading (and refusal of held-out data), strategies,
decisions, accounting and the command line, on a tiny random model and synthetic data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import DEFAULT_REPAIR, prefix_digest
from kvnotes.research.tool_runs import CaseResult, Outcome
from kvnotes_bench.cli import app
from kvnotes_bench.tools import HeldOutDataError, ToolsBenchConfig, load_cases, run_bench
from kvnotes_bench.tools.choice import choose, name_trie
from kvnotes_bench.tools.data import category_file, first_call_name, spread
from kvnotes_bench.tools.prompt import SKILL_OPENING, STAND_IN, case_prompt, skill_text
from kvnotes_bench.tools.runner import calibrate_tau, guard_curve, run_case
from kvnotes_bench.tools.strategies import (
    SkillCache,
    Variant,
    build,
    exact_ids,
    parse_strategies,
    parse_strategy,
    spliced_temperature,
    variants,
)

HELD_OUT = ("multiple", "parallel_multiple", "simple_python", "simple_java", "live_simple",
            "live_parallel", "live_parallel_multiple", "irrelevance", "live_irrelevance")


def _fn(name: str, what: str) -> dict:
    return {"name": name, "description": f"{what}.",
            "parameters": {"type": "dict", "required": ["x"],
                           "properties": {"x": {"type": "string", "description": "input"}}}}


def _write_lines(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture
def bfcl_root(tmp_path: Path) -> Path:
    """A folder in BFCL's data layout with a few synthetic cases of both development sets."""
    root = tmp_path / "data"
    tools = [("get_weather", "Weather of a city"), ("get_time", "Local time of a city"),
             ("book_taxi", "Book a taxi"), ("send_mail", "Send an email")]
    cases, answers = [], []
    for i in range(6):
        fns = [_fn(*tools[(i + j) % 4]) for j in range(2 + i % 2)]
        cases.append({"id": f"live_multiple_{i}", "question": [[
            *([{"role": "system", "content": "Be brief."}] if i == 1 else []),
            {"role": "user", "content": f"Question {i} about {fns[0]['name']}?"}]],
            "function": fns})
        answers.append({"id": f"live_multiple_{i}",
                        "ground_truth": [{fns[0]["name"]: {"x": ["a"]}}]})
    _write_lines(root / "BFCL_v4_live_multiple.json", cases)
    _write_lines(root / "possible_answer" / "BFCL_v4_live_multiple.json", answers)
    _write_lines(root / "multi_turn_func_doc" / "math_api.json",
                 [_fn("add", "Add two numbers"), _fn("mean", "Mean of numbers"),
                  _fn("logarithm", "Logarithm of a number")])
    _write_lines(root / "multi_turn_func_doc" / "message_api.json",
                 [_fn("send_message", "Send a message"), _fn("view_messages", "View messages")])
    _write_lines(root / "BFCL_v4_multi_turn_base.json", [
        {"id": "multi_turn_base_0", "question": [[{"role": "user", "content": "Add 2 and 3."}]],
         "involved_classes": ["MathAPI", "MessageAPI"], "excluded_function": ["mean"]},
        {"id": "multi_turn_base_1", "question": [[{"role": "user", "content": "Message Bo."}]],
         "involved_classes": ["MessageAPI"]}])
    _write_lines(root / "possible_answer" / "BFCL_v4_multi_turn_base.json", [
        {"id": "multi_turn_base_0", "ground_truth": [["add(a=2, b=3)"]]},
        {"id": "multi_turn_base_1", "ground_truth": [["send_message(receiver_id='Bo')"]]}])
    return root


# ---- data ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("category", HELD_OUT)
def test_held_out_categories_are_refused_by_name(bfcl_root: Path, category: str) -> None:
    # a file of that name exists, yet nothing opens it: the name alone is refused
    (bfcl_root / f"BFCL_v4_{category}.json").write_text("not json\n", encoding="utf-8")
    with pytest.raises(HeldOutDataError, match="held out"):
        category_file(bfcl_root, category)
    with pytest.raises(HeldOutDataError, match="held out"):
        load_cases(category, bfcl_root)
    with pytest.raises(HeldOutDataError, match="held out"):
        category_file(bfcl_root, category, answers=True)


def test_unknown_set_names_the_development_sets(bfcl_root: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="live_multiple, multi_turn"):
        load_cases("multi_turn_base", bfcl_root)


def test_live_multiple_cases_keep_order_system_and_answers(bfcl_root: Path) -> None:
    cases = load_cases("live_multiple", bfcl_root)
    assert [c.id for c in cases] == [f"live_multiple_{i}" for i in range(6)]
    assert cases[0].candidates == ("get_weather", "get_time")
    assert cases[1].candidates == ("get_time", "book_taxi", "send_mail")
    assert cases[1].system == "Be brief." and cases[0].system == ""
    assert cases[1].answers == ("get_time",)
    assert json.loads(cases[0].skills[0].text)["name"] == "get_weather"


def test_multi_turn_cases_are_class_manuals_without_excluded_functions(bfcl_root: Path) -> None:
    cases = load_cases("multi_turn", bfcl_root)
    first = cases[0]
    assert [s.name for s in first.skills] == ["MathAPI", "MessageAPI"]
    assert first.candidates == ("add", "logarithm", "send_message", "view_messages")
    assert first.answers == ("add",) and cases[1].answers == ("send_message",)
    assert len(first.skills[0].text.splitlines()) == 2  # one function per line


def test_first_call_name_and_spread() -> None:
    assert first_call_name(["cd(folder='x')", "ls()"]) == "cd"
    assert first_call_name(["  math.add(a=1)"]) == "math.add"
    assert first_call_name([]) is None
    assert spread(list(range(10)), 5) == [0, 2, 4, 6, 8]
    assert spread(list(range(3)), 0) == [0, 1, 2]


# ---- strategies ----------------------------------------------------------------------------------
def test_strategy_names_parse_and_bad_ones_say_the_forms() -> None:
    s = parse_strategy("anchor+kvdev:0.2")
    assert (s.kind, s.anchor, s.select, s.repair) == ("compose", True, "kv_deviation", 0.2)
    e = parse_strategy("anchor+epic:16")
    assert (e.anchor, e.first_k, e.repair) == (True, 16, 0.0)
    g = parse_strategy("guard:first:0.1@0.5")
    assert (g.kind, g.base, g.tau) == ("guard", "first:0.1", 0.5)
    names = [x.name for x in parse_strategies(["guard:splice"])]
    assert names == ["exact", "splice", "guard:splice"]
    with pytest.raises(InvalidArgumentError, match="unknown strategy 'repair'.*first:F"):
        parse_strategy("repair")
    with pytest.raises(InvalidArgumentError, match="in \\[0, 1\\]"):
        parse_strategy("first:1.5")
    with pytest.raises(InvalidArgumentError, match="guards a composed strategy"):
        parse_strategy("guard:exact")


def test_ape_and_default_strategies_parse() -> None:
    a = parse_strategy("ape:1.2+epic:32")
    assert (a.kind, a.temperature, a.first_k, a.repair) == ("compose", 1.2, 32, 0.0)
    b = parse_strategy("ape:0.9")
    assert (b.name, b.temperature, b.first_k) == ("ape:0.9", 0.9, 0)
    assert parse_strategy("guard:ape:1.1+epic:16").base == "ape:1.1+epic:16"
    d = parse_strategy("default")
    assert (d.kind, d.engine_default) == ("compose", True)
    with pytest.raises(InvalidArgumentError, match="ape:T or ape:T\\+epic:K"):
        parse_strategy("ape:1.2+first:0.1")
    with pytest.raises(InvalidArgumentError, match="in \\[0.05, 20\\]"):
        parse_strategy("ape:0")


def test_composed_prompt_has_the_exact_prompts_token_ids(tiny_llama, bfcl_root: Path) -> None:
    case = load_cases("live_multiple", bfcl_root)[1]
    prompt = case_prompt(tiny_llama.tokenizer, case)
    ids, prefix = exact_ids(tiny_llama, prompt)
    skills = SkillCache(tiny_llama)
    for name in ("splice", "anchor+first:0.2", "kvdev:0.3", "epic:4", "ape:1.5+epic:4",
                 "default", "pred", "pred+epic:4"):
        nb = build(tiny_llama, prompt, parse_strategy(name), skills)
        assert nb.token_ids.tolist() == ids
    assert ids[:prefix] == tiny_llama.encode(prompt.header)
    assert "Be brief." in prompt.question and prompt.query == '{"name": "'


def test_name_choice_tells_apart_names_with_a_common_prefix(tiny_llama) -> None:
    names = ["get_weather", "get_time", "book_taxi"]
    trie = name_trie(tiny_llama, names)
    assert trie.ids[0][0] == trie.ids[1][0]  # "get" is shared: a first token cannot decide
    nb = tiny_llama.prefill("Which tool? ")
    step = tiny_llama.forward(nb, tiny_llama.encode('{"name": "'))
    d = choose(tiny_llama, step.notebook, step.logits, trie)
    assert d.answer in names and d.margin >= 0
    assert set(d.scores) == set(names)
    # the first step compares "get" with "book": the loser's score is its first token's logit
    loser = "book_taxi" if d.answer.startswith("get") else "get_weather"
    assert d.scores[loser] == pytest.approx(float(step.logits[trie.ids[names.index(loser)][0]]))


def test_exact_is_identical_to_itself_and_fractions_add_up(tiny_llama, bfcl_root: Path) -> None:
    case = load_cases("live_multiple", bfcl_root)[1]
    prompt = case_prompt(tiny_llama.tokenizer, case)
    strategies = parse_strategies(["exact", "splice", "first:0.25", "kvdev:0.25", "first:1.0",
                                   "epic:4", "anchor+epic:2", "guard:splice@1000"])
    r = run_case(tiny_llama, case, prompt, strategies, SkillCache(tiny_llama), half="evaluate",
                 taus={}, greedy_tokens=3)
    exact = r.outcome("exact")
    assert exact.identical and exact.first_token_agree and exact.greedy_identical
    assert exact.kl == pytest.approx(0.0, abs=1e-9) and exact.compute_fraction == 1.0
    for o in r.outcomes:
        assert o.reused + o.computed + o.repaired == o.tokens_total == r.tokens
        assert o.spliced == o.reused + o.repaired
    splice, full = r.outcome("splice"), r.outcome("first:1.0")
    assert splice.repaired == 0 and splice.compute_fraction < 1.0
    # every spliced token recomputed but the first tool's, which is exact where it lies
    assert full.reused == len(tiny_llama.encode(prompt.skills[0]))
    assert full.identical and full.kl < 1e-6
    kvdev = r.outcome("kvdev:0.25")
    assert kvdev.select_tokens > 0 and kvdev.compute_fraction > r.outcome("first:0.25").compute_fraction
    # the first tool sits right after the header it was compiled behind: not repaired
    assert r.outcome("epic:4").repaired == 4 * (r.skills - 1)
    assert r.outcome("anchor+epic:2").repaired == 2 * r.skills  # compiled behind a stand-in
    guard = r.outcome("guard:splice@1000")  # a huge threshold always fires: exact notes
    assert guard.guard_fired and guard.identical and guard.kl < 1e-6
    assert guard.guard_tokens == r.tokens - r.exact_prefix
    assert guard.compute_fraction == pytest.approx(
        (guard.computed + guard.guard_tokens) / r.tokens)


def test_ape_temperature_scales_only_the_kept_spliced_keys(tiny_llama, bfcl_root: Path) -> None:
    case = load_cases("live_multiple", bfcl_root)[1]
    prompt = case_prompt(tiny_llama.tokenizer, case)
    skills = SkillCache(tiny_llama)
    compiled = [skills.get(Variant(t, prompt.header)) for t in prompt.skills]
    nb = tiny_llama.compose([prompt.header, *compiled], repair=0)
    spliced = list(range(len(nb) - sum(len(c) for c in compiled), len(nb)))
    same = spliced_temperature(nb, spliced, 1.0)
    sharp = spliced_temperature(nb, spliced, 0.2)  # a tiny random model's scores are small
    for layer in range(nb.num_layers):
        assert torch.equal(same.keys(layer), nb.keys(layer))
        assert torch.allclose(sharp.keys(layer)[..., spliced, :], nb.keys(layer)[..., spliced, :]
                              / 0.2)
        assert torch.equal(sharp.keys(layer)[..., :spliced[0], :],
                           nb.keys(layer)[..., :spliced[0], :])
        assert torch.equal(sharp.values(layer), nb.values(layer))
    q = prompt.question + prompt.query
    plain = tiny_llama.next_logits(nb, q)
    assert torch.allclose(tiny_llama.next_logits(same, q), plain, atol=1e-5)
    assert (tiny_llama.next_logits(sharp, q) - plain).abs().max() > 1e-3

    # as a strategy: the same token ids, the question attends to the scaled keys, and
    # epic's repaired tokens keep theirs
    ape = build(tiny_llama, prompt, parse_strategy("ape:0.2+epic:4"), skills)
    epic = build(tiny_llama, prompt, parse_strategy("epic:4"), skills)
    assert ape.token_ids.tolist() == epic.token_ids.tolist()
    assert ape.meta["compose"]["repaired"] == epic.meta["compose"]["repaired"]
    a, b = epic.meta["compose"]["regions"][0]
    assert torch.allclose(ape.keys(0)[..., a:b, :], epic.keys(0)[..., a:b, :], atol=1e-5)
    assert not torch.allclose(ape.keys(0)[..., b:b + 1, :], epic.keys(0)[..., b:b + 1, :])
    assert not torch.allclose(tiny_llama.next_logits(ape, prompt.query),
                              tiny_llama.next_logits(epic, prompt.query), atol=1e-3)


def test_default_strategy_is_the_engines_default_repair(tiny_llama, bfcl_root: Path) -> None:
    case = load_cases("live_multiple", bfcl_root)[1]
    prompt = case_prompt(tiny_llama.tokenizer, case)
    skills = SkillCache(tiny_llama)
    nb = build(tiny_llama, prompt, parse_strategy("default"), skills)
    assert nb.meta["compose"]["repair"] == DEFAULT_REPAIR.tag()
    same = build(tiny_llama, prompt, parse_strategy(f"epic:{DEFAULT_REPAIR.first}"), skills)
    assert nb.meta["compose"]["regions"] == same.meta["compose"]["regions"]
    assert torch.allclose(tiny_llama.next_logits(nb, prompt.query),
                          tiny_llama.next_logits(same, prompt.query), atol=1e-5)


def test_pred_strategies_parse_and_malformed_ones_say_the_forms() -> None:
    p = parse_strategy("pred")
    assert (p.kind, p.predecessor, p.anchor, p.first_k, p.repair) == ("compose", True, False,
                                                                      0, 0.0)
    e = parse_strategy("pred+epic:16")
    assert (e.name, e.predecessor, e.anchor, e.first_k) == ("pred+epic:16", True, False, 16)
    assert not parse_strategy("anchor+epic:16").predecessor
    assert parse_strategy("guard:pred+epic:32").base == "pred+epic:32"
    for bad in ("pred+first:0.1", "pred+epic:", "pred+epic:x", "pred:3", "pred+anchor"):
        with pytest.raises(InvalidArgumentError, match="pred or pred\\+epic:K"):
            parse_strategy(bad)
    with pytest.raises(InvalidArgumentError, match="unknown strategy 'anchor\\+pred'.*pred, "
                                                   "pred\\+epic:K"):
        parse_strategy("anchor+pred")
    with pytest.raises(InvalidArgumentError, match="ape:T or ape:T\\+epic:K"):
        parse_strategy("ape:1.2+pred+epic:8")


def test_pred_compiles_each_skill_behind_its_predecessor(tiny_llama, bfcl_root: Path) -> None:
    case = load_cases("live_multiple", bfcl_root)[1]  # three tools
    prompt = case_prompt(tiny_llama.tokenizer, case)
    header = tiny_llama.anchor_ids(prompt.header)
    wanted = variants(prompt, parse_strategy("pred+epic:2"))
    assert [v.behind for v in wanted] == ["", *prompt.skills[:2]]
    skills = SkillCache(tiny_llama)
    compiled = [skills.get(v) for v in wanted]
    # the first behind the header alone (as the splice's), each other behind its predecessor
    assert compiled[0].meta["prefix_len"] == len(header)
    assert compiled[0].meta["prefix_digest"] == prefix_digest(header)
    assert compiled[0] is skills.get(Variant(prompt.skills[0], prompt.header))
    for i in (1, 2):
        behind = [*header, *tiny_llama.encode(prompt.skills[i - 1])]
        assert compiled[i].meta["prefix_len"] == len(behind)
        assert compiled[i].meta["prefix_digest"] == prefix_digest(behind)
        assert compiled[i].start_position == len(behind)
    # compose finds the first two exactly placed (the second's prefix is the whole prefix
    # before it) and repairs the third, compiled behind the second alone
    ids, _ = exact_ids(tiny_llama, prompt)
    exact = tiny_llama.prefill(ids)
    pred = build(tiny_llama, prompt, parse_strategy("pred"), skills)
    epic = build(tiny_llama, prompt, parse_strategy("pred+epic:2"), skills)
    third = len(header) + sum(len(tiny_llama.encode(t)) for t in prompt.skills[:2])
    assert pred.meta["compose"]["exact"] == epic.meta["compose"]["exact"] == [1, 2]
    assert (pred.meta["compose"]["repaired"], epic.meta["compose"]["repaired"]) == (0, 2)
    assert epic.meta["compose"]["regions"] == [[third, third + 2]]
    for layer in range(pred.num_layers):
        assert torch.allclose(pred.keys(layer)[..., :third, :], exact.keys(layer)[..., :third, :],
                              atol=1e-4)
    last = pred.num_layers - 1  # (layer 0's keys do not depend on the context)
    assert not torch.allclose(pred.keys(last)[..., third:, :], exact.keys(last)[..., third:, :],
                              atol=1e-4)
    # the bench's counts are compose's own
    r = run_case(tiny_llama, case, prompt, parse_strategies(["pred", "pred+epic:2", "epic:2"]),
                 skills, half="evaluate", taus={})
    assert r.outcome("pred").repaired == 0 and r.outcome("pred").exact_skills == 2
    assert r.outcome("pred+epic:2").repaired == 2 * (r.skills - 2)
    assert r.outcome("epic:2").repaired == 2 * (r.skills - 1)
    assert r.outcome("epic:2").exact_skills == 1 and r.outcome("exact").exact_skills is None
    # two tools: both exactly placed, so the splice is the exact prompt's notes
    two = load_cases("live_multiple", bfcl_root)[0]
    r2 = run_case(tiny_llama, two, case_prompt(tiny_llama.tokenizer, two),
                  parse_strategies(["pred"]), skills, half="evaluate", taus={})
    assert r2.skills == 2 and r2.outcome("pred").kl < 1e-6 and r2.outcome("pred").identical


def test_variant_library_is_counted_per_strategy(tiny_llama, bfcl_root: Path) -> None:
    config = ToolsBenchConfig(set="live_multiple", cases=0, strategies=("splice", "pred", "anchor"),
                         data_root=bfcl_root, max_context=10_000)
    result = run_bench(tiny_llama, config, model="tiny")
    prompts = [case_prompt(tiny_llama.tokenizer, c) for c in load_cases("live_multiple",
                                                                       bfcl_root)]
    texts = {t for p in prompts for t in p.skills}
    pairs = {(p.skills[i - 1] if i else "", t) for p in prompts for i, t in enumerate(p.skills)}
    assert len(pairs) > len(texts)  # some skill follows more than one predecessor
    rows = {s.strategy: s for s in result.summaries}
    assert (rows["pred"].variants, rows["pred"].distinct_skills) == (len(pairs), len(texts))
    assert (rows["splice"].variants, rows["splice"].distinct_skills) == (len(texts), len(texts))
    assert rows["anchor"].variants == len(texts) and rows["exact"].variants is None
    # pred's first skills are the splice's own compiled notes (one cache entry each); the
    # anchor's are compiled behind the stand-in
    assert result.settings["variants_compiled"] == len(pairs | {("", t) for t in texts}) + len(
        texts)
    skills = SkillCache(tiny_llama)
    first = [Variant(t, "h") for t in ("a", "b")]
    assert skills.record("pred", first) == (2, 2)
    assert skills.record("pred", [*first, Variant("b", "h", "a")]) == (1, 0)
    assert skills.record("splice", first) == (2, 2)  # another strategy's library


def test_skill_opening_changes_the_exact_and_composed_prompt_alike(tiny_llama,
                                                                   bfcl_root: Path) -> None:
    case = load_cases("live_multiple", bfcl_root)[1]
    plain = case_prompt(tiny_llama.tokenizer, case)
    opened = case_prompt(tiny_llama.tokenizer, case, SKILL_OPENING)
    assert opened.skills == tuple(skill_text(s.text, SKILL_OPENING) for s in case.skills)
    assert all(t.startswith("\n" + SKILL_OPENING + "{") for t in opened.skills)
    assert (opened.header, opened.question) == (plain.header, plain.question)
    ids, prefix = exact_ids(tiny_llama, opened)
    assert ids != exact_ids(tiny_llama, plain)[0]
    skills = SkillCache(tiny_llama)
    for name in ("splice", "epic:4", "pred", "anchor"):
        assert build(tiny_llama, opened, parse_strategy(name), skills).token_ids.tolist() == ids
    # every skill's first tokens are the same text
    starts = [prefix]
    for t in opened.skills[:-1]:
        starts.append(starts[-1] + len(tiny_llama.encode(t)))
    head = tiny_llama.encode("\n" + SKILL_OPENING)[:-1]
    assert all(ids[a:a + len(head)] == head for a in starts)
    # the anchor's stand-in is listed as the skills are
    assert variants(opened, parse_strategy("anchor"))[0].behind == skill_text(STAND_IN,
                                                                             SKILL_OPENING)
    with pytest.raises(InvalidArgumentError, match="skill_opening"):
        ToolsBenchConfig(skill_opening=" \n")


def test_cli_records_the_skill_opening_and_the_library(tiny_folder: Path, bfcl_root: Path,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "opening"
    res = CliRunner().invoke(app, [
        "tools", "--model", str(tiny_folder), "--set", "live_multiple", "--cases", "3",
        "--strategies", "exact,splice,pred+epic:2", "--skill-opening", "Function:\\n",
        "--data", str(bfcl_root), "--threads", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["skill_opening"] == "Function:\n"
    rows = {s["strategy"]: s for s in data["summaries"]}
    assert rows["pred+epic:2"]["variants"] >= rows["pred+epic:2"]["distinct_skills"] > 0
    report = (out / "report.md").read_text()
    assert 'starts with "Function:\\n"' in report
    assert "variants compiled / distinct skills" in report
    assert f"| {rows['pred+epic:2']['variants']} / {rows['pred+epic:2']['distinct_skills']} |" \
        in report
    (out / "results.json").unlink()
    res = CliRunner().invoke(app, ["tools-report", str(out)])
    assert res.exit_code == 0, res.output
    again = json.loads((out / "results.json").read_text())
    assert again["summaries"] == data["summaries"]
    assert again["settings"]["skill_opening"] == "Function:\n"


def _outcome(strategy: str, *, same: bool, margin: float) -> Outcome:
    return Outcome(strategy, "a" if same else "b", "a", same, margin, same, 0.1, 0.99, 1.0,
                   100, 80, 20, 0, 0.0, 0, 80, 0.01)


def _case(i: int, outcome: Outcome) -> CaseResult:
    return CaseResult(f"c{i}", "calibrate", 2, 2, 100, 20, ("a",),
                      (_outcome("exact", same=True, margin=2.0), outcome))


def test_guard_threshold_is_the_smallest_that_catches_the_flips() -> None:
    cases = [_case(0, _outcome("splice", same=True, margin=0.2)),
             _case(1, _outcome("splice", same=False, margin=0.5)),
             _case(2, _outcome("splice", same=False, margin=1.5)),
             _case(3, _outcome("splice", same=True, margin=3.0))]
    assert calibrate_tau(cases, "splice", 1.0) == pytest.approx(1.5001)
    assert calibrate_tau(cases, "splice", 0.75) == pytest.approx(0.5001)
    assert calibrate_tau(cases[:1], "splice", 1.0) == 0.0
    low, high = guard_curve(cases, "splice", [0.0, 2.0])
    assert (low.identical, low.fires, low.compute_fraction) == (2, 0, pytest.approx(0.2))
    assert (high.identical, high.fires) == (4, 3)
    assert high.compute_fraction == pytest.approx((0.2 + 3 * 1.0) / 4)  # 20 + 80 recomputed


def test_run_bench_calibrates_on_one_half_and_reports_on_the_other(tiny_llama,
                                                                 bfcl_root: Path) -> None:
    config = ToolsBenchConfig(set="live_multiple", cases=0, strategies=("splice", "guard:splice"),
                         data_root=bfcl_root, max_context=10_000)
    result = run_bench(tiny_llama, config, model="tiny")
    assert [c.half for c in result.cases] == ["calibrate"] * 3 + ["evaluate"] * 3
    assert set(result.taus) == {"guard:splice"}
    guard = next(s for s in result.summaries if s.strategy == "guard:splice")
    assert guard.cases == 3 and guard.guard_tau == pytest.approx(result.taus["guard:splice"])
    assert all(c.outcome("guard:splice") is None for c in result.cases if c.half == "calibrate")
    assert "load_average" in result.machine
    small = run_bench(tiny_llama, ToolsBenchConfig(set="multi_turn", cases=0, strategies=("splice",),
                                              data_root=bfcl_root, max_context=60), model="tiny")
    assert len(small.cases) + len(small.skipped) == 2 and small.skipped
    assert "context limit of 60" in small.skipped[0].reason


def test_cli_runs_end_to_end(tiny_folder: Path, bfcl_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    res = CliRunner().invoke(app, [
        "tools", "--model", str(tiny_folder), "--set", "multi_turn", "--cases", "2",
        "--strategies", "exact,splice,first:0.2,anchor,guard:splice", "--greedy", "2",
        "--data", str(bfcl_root), "--threads", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "results.json").read_text())
    assert data["set"] == "multi_turn" and len(data["cases"]) == 2
    assert [s["strategy"] for s in data["summaries"]] == ["exact", "splice", "first:0.2",
                                                          "anchor", "guard:splice"]
    assert (out / "identity.png").stat().st_size > 0
    assert "choice identical to exact" in (out / "report.md").read_text()
    assert len((out / "cases.jsonl").read_text().splitlines()) == 2
    assert not math.isnan(data["summaries"][0]["compute_fraction"])
    # a stopped run's folder (cases.jsonl + run.json) rebuilds the same summaries
    (out / "results.json").unlink()
    res = CliRunner().invoke(app, ["tools-report", str(out)])
    assert res.exit_code == 0, res.output
    again = json.loads((out / "results.json").read_text())
    assert again["summaries"] == data["summaries"] and again["taus"] == data["taus"]


def test_cli_refuses_a_held_out_set_in_one_line(bfcl_root: Path) -> None:
    res = CliRunner().invoke(app, ["tools", "--model", "smollm2-135m", "--set",
                                   "irrelevance", "--data", str(bfcl_root)])
    assert res.exit_code == 2
    assert "held out" in res.output


def test_real_smollm2_cases(smollm2) -> None:
    config = ToolsBenchConfig(set="live_multiple", cases=2, strategies=("splice", "first:0.1"),
                         max_context=2048, greedy_tokens=4)
    result = run_bench(smollm2, config, model="smollm2-135m")
    candidates = {c.id: c.candidates for c in spread(load_cases("live_multiple"), 2)}
    assert len(result.cases) + len(result.skipped) == 2 and result.cases
    for case in result.cases:
        exact = case.outcome("exact")
        assert exact.identical and exact.greedy_identical and exact.kl < 1e-9
        for o in case.outcomes:
            assert o.reused + o.computed + o.repaired == o.tokens_total
            assert o.choice in candidates[case.id]


@pytest.mark.parametrize("field, value", [("cases", -1), ("greedy_tokens", -2), ("max_context", 0),
                                          ("guard_target", 0.0), ("cases", True)])
def test_bench_config_refuses_bad_settings(field, value):
    from kvnotes.core.errors import InvalidArgumentError
    from kvnotes_bench.tools import ToolsBenchConfig

    with pytest.raises(InvalidArgumentError, match=field):
        ToolsBenchConfig(**{field: value})


def test_library_strategy_is_compose_defaults_with_predecessor_variants(tiny_llama,
                                                                         bfcl_root: Path) -> None:
    s = parse_strategy("library")
    assert (s.kind, s.library, s.engine_default) == ("compose", True, True)
    case = load_cases("live_multiple", bfcl_root)[1]  # three tools
    prompt = case_prompt(tiny_llama.tokenizer, case)
    skills = SkillCache(tiny_llama)
    lib = build(tiny_llama, prompt, s, skills)
    pred = build(tiny_llama, prompt, parse_strategy(f"pred+epic:{DEFAULT_REPAIR.first}"), skills)
    # the library's variants are swapped in for the second and third skills: pred's layout
    assert lib.meta["compose"]["variants"] == [2, 3]
    for key in ("exact", "regions", "repaired"):
        assert lib.meta["compose"][key] == pred.meta["compose"][key]
    assert torch.allclose(tiny_llama.next_logits(lib, prompt.query),
                          tiny_llama.next_logits(pred, prompt.query), atol=1e-5)
    # the library counted per strategy: the header-anchored skills and their variants
    assert len(variants(prompt, s)) == 2 * len(prompt.skills) - 1
