"""kvnotes.apps.agent on a tiny random model: episodes end to end, append-only notebooks, the skill
library, tool-call validation and errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_engine
from typer.testing import CliRunner

from kvnotes.apps.agent import (
    FIELDS,
    Event,
    KvnotesAgent,
    RecomputeAgent,
    Request,
    SkillBook,
    State,
    Turn,
    UnknownSkillError,
    parse_tool_call,
    request,
    run_episode,
    scripted_episode,
    scripted_episodes,
    skill_names,
)
from kvnotes.apps.agent.bench import report_markdown, run_bench, write_outputs
from kvnotes.core.errors import KvnotesError, UnknownFieldError, UnknownNameError


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)


@pytest.fixture(scope="module")
def skill_root(tmp_path_factory):
    return tmp_path_factory.mktemp("skills")


@pytest.fixture(scope="module")
def book(engine, skill_root):
    b = SkillBook(engine, skill_root)
    b.prepare()
    agent = KvnotesAgent(engine, b)
    b.prepare(after=agent.after)  # what the (anchored) agent splices, and its header
    b.header(agent.prompt.head())
    return b


def _prefix(a, b) -> bool:
    """True when notebook ``a`` is an exact prefix of notebook ``b`` (ids, positions, KV)."""
    n = len(a)
    return (len(b) >= n and torch.equal(b.token_ids[:n], a.token_ids)
            and torch.equal(b.positions[:n], a.positions)
            and all(torch.equal(lb.keys[..., :n, :], la.keys)
                    and torch.equal(lb.values[..., :n, :], la.values)
                    for la, lb in zip(a.layers, b.layers, strict=True))
            and list(b.spans[:len(a.spans)]) == list(a.spans))


def test_skills_are_realistic_package_data():
    names = skill_names()
    assert {"cancellation", "baggage", "refunds", "compensation", "account_changes"} <= set(names)
    from kvnotes.apps.agent import skill_text

    assert all(len(skill_text(n).split()) >= 200 for n in names)


def test_scripted_episodes_are_deterministic_with_state_changes():
    eps = scripted_episodes(40, 5)
    assert len(eps) == 40 and all(len(e.turns) == 5 for e in eps)
    assert sum(bool(t.events) for e in eps for t in e.turns) >= 80
    assert scripted_episode(3, 5) == scripted_episodes(4, 5)[3]
    assert scripted_episode(3, 3).turns == scripted_episode(3, 5).turns[:3]


def test_episode_end_to_end_and_append_only(engine, book):
    episode = scripted_episode(0, 3)
    agent = KvnotesAgent(engine, book)
    agent.start(episode.state)
    previous = None
    for turn in episode.turns:
        result = agent.turn(turn.request, turn.events)
        assert result.decision.answer in turn.request.options
        assert set(result.decision.scores) == set(turn.request.options)
        assert result.tokens_computed > 0 and result.notebook_len == len(agent.notebook)
        if previous is not None:
            assert _prefix(previous, agent.notebook), "the notebook must grow append-only"
            assert result.tokens_reused >= len(previous)
        previous = agent.notebook
    kinds = {s.kind for s in agent.notebook.spans}
    assert {"skill", "query"} <= kinds
    errata = [s for s in agent.notebook.spans if s.kind == "erratum"]
    assert len(errata) == sum(len(t.events) for t in episode.turns[1:])
    assert agent.state == episode.state.apply(e for t in episode.turns for e in t.events)

    reference = run_episode(RecomputeAgent(engine, book), episode.state, episode.turns)
    assert [r.decision.answer in t.request.options
            for r, t in zip(reference, episode.turns, strict=True)] == [True] * 3
    assert all(r.tokens_reused == 0 and r.tokens_computed == r.notebook_len for r in reference)


def test_without_state_changes_both_agents_read_the_same_tokens(engine, book):
    state = scripted_episode(1).state
    turns = [Turn(request(k, state)) for k in ("cancel", "add_bag", "compensation")]
    kv = KvnotesAgent(engine, book)
    kv.start(state)
    ref = RecomputeAgent(engine, book)
    ref.start(state)
    for t in turns:
        a, b = kv.turn(t.request), ref.turn(t.request)
        assert a.notebook_len == b.notebook_len  # same token sequence, spliced vs recomputed
        for option in t.request.options:  # splicing is close to recompute, not bit-exact:
            # a skill compiled alone never attended to what precedes it in the notebook
            assert a.decision.scores[option] == pytest.approx(b.decision.scores[option], abs=0.05)
    assert kv.turns[-1].tokens_computed < ref.turns[-1].tokens_computed / 5


def test_skills_compile_once_per_model(engine, book, skill_root):
    again = SkillBook(engine, skill_root)
    again.prepare()
    again.header("anything new\n")
    assert again.library.hits == len(skill_names())
    assert again.library.misses == 1  # only the header text never seen before
    other = make_tiny_engine("llama", engine.tokenizer, seed=1)
    fresh = SkillBook(other, skill_root)
    fresh.notes("refunds")
    assert (fresh.library.hits, fresh.library.misses) == (0, 1)  # namespaced by model


@pytest.mark.parametrize("raw, error", [
    ("sure, I will do that", "no complete JSON object in the output"),
    ('{"tool": "cancel_reservation", "args": {"reservation_id": "X1"', "no complete JSON object"),
    ("{'tool': 'x'}", "invalid JSON"),
    ('{"tool": "cancel_reservation"}', "expected keys ['args', 'tool'], got ['tool']"),
    ('{"tool": "fly_me", "args": {}}', "unknown tool 'fly_me'"),
    ('{"tool": "issue_voucher", "args": {"reservation_id": "X1"}}',
     "issue_voucher: missing arguments ['amount'], unexpected []"),
    ('{"tool": "issue_voucher", "args": {"reservation_id": "X1", "amount": "100"}}',
     "issue_voucher: argument 'amount' must be int"),
])
def test_malformed_tool_calls_are_reported(raw, error):
    call = parse_tool_call(raw)
    assert not call.ok and call.raw == raw
    assert call.error.startswith(error)


def test_valid_tool_call_is_parsed():
    call = parse_tool_call('{"tool": "issue_voucher", "args": {"reservation_id": "X1", '
                           '"amount": 100}}}\n', expected="issue_voucher")
    assert call.ok and call.args == {"reservation_id": "X1", "amount": 100}
    wrong = parse_tool_call('{"tool": "issue_voucher", "args": {"reservation_id": "X1", '
                            '"amount": 100}}', expected="update_baggage")
    assert not wrong.ok and "needs 'update_baggage'" in wrong.error


def test_malformed_tool_call_from_the_model_is_reported_not_raised(engine, book):
    state = scripted_episode(2).state
    agent = KvnotesAgent(engine, book, tool_calls=True, max_tool_tokens=8)
    agent.start(state)
    result = agent.turn(request("add_bag", state))  # both options act: a call is always made
    assert result.tool_call is not None
    assert not result.tool_call.ok and result.tool_call.error
    assert result.tool_call.raw.startswith('{"tool": "')


def test_unknown_state_field_and_skill_are_clear_errors(engine, book):
    with pytest.raises(UnknownFieldError) as err:
        Event("seat", "12A")
    assert str(err.value) == f"unknown state field 'seat'; the record has fields: {sorted(FIELDS)}"
    with pytest.raises(KvnotesError, match="unknown state field 'vip'"):
        State({"vip": "yes"})
    agent = KvnotesAgent(engine, book)
    agent.start(scripted_episode(0).state)
    bad = Request("Do a thing.", ("teleportation",), ("yes", "no"))
    with pytest.raises(UnknownSkillError) as err:
        agent.turn(bad)
    assert str(err.value) == ("unknown skill 'teleportation'; valid skills: "
                              + ", ".join(skill_names()))
    assert isinstance(err.value, UnknownNameError) and isinstance(err.value, KeyError)
    with pytest.raises(UnknownNameError, match="^unknown request kind 'fly'; valid request kinds: "):
        request("fly", agent.state)
    with pytest.raises(KvnotesError, match="call start"):
        KvnotesAgent(engine, book).turn(request("human", agent.state))


def test_bench_writes_json_report_and_plot(engine, book, skill_root, tmp_path):
    result = run_bench(engine, scripted_episodes(1, 2), skill_root=skill_root)
    assert result["decisions"] == 2 and 0.0 <= result["identity"] <= 1.0
    assert "identity_after_state_change" in result["stale"]
    assert result["tokens"]["kvnotes_computed"] < result["tokens"]["recompute_computed"]
    assert len(result["per_turn"]) == 2 and result["skills"]["compiled_now"] == 0
    paths = write_outputs(result, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["flip_count"] == len(data["flips"])
    assert "decision identity with recompute" in paths["report"].read_text()
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"


def test_interactive_agent_handles_requests_state_changes_and_eof(engine, skill_root,
                                                                  monkeypatch):
    from kvnotes.cli import app
    from kvnotes.core import models

    monkeypatch.setattr(models, "load", lambda model, **device_dtype: engine)
    lines = "I need to cancel my trip\n/set insurance purchased\n/set seat 12A\n/state\n" \
            "Can I add a bag?\n"
    result = CliRunner().invoke(app, ["agent", "--model", "tiny", "--skills-dir",
                                      str(skill_root)], input=lines)
    assert result.exit_code == 0, result.output
    assert result.output.count("decision: ") == 2
    assert "Travel insurance: purchased" in result.output
    assert "unknown state field 'seat'" in result.output
    assert "reused" in result.output and "computed" in result.output


def test_agent_skills_are_compiled_behind_its_header(engine, book):
    agent = KvnotesAgent(engine, book)
    head = engine.encode(agent.after)
    skill = book.notes("refunds", after=agent.after)
    assert int(skill.positions[0]) == len(head)  # true positions behind the header
    plain = KvnotesAgent(engine, book, anchored=False)
    assert plain.after is None and int(book.notes("refunds").positions[0]) == 0


def test_guarded_agent_redecides_near_ties_on_exact_notes(engine, book):
    episode = scripted_episodes(1, 2)[0]
    agent = KvnotesAgent(engine, book, guard=1e9)  # every margin is below: always fires
    results = run_episode(agent, episode.state, episode.turns)
    g = results[0].decision.guard
    assert g is not None and g.fired and results[0].to_dict()["guard"]["fired"] is True
    # the header and the first skill (anchored behind it, spliced where it was compiled) are
    # exact already: only the rest is redone
    first = [s for s in dict.fromkeys(["tools", *episode.turns[0].request.skills])][0]
    kept = len(book.header(agent.prompt.head())) + len(book.notes(first, after=agent.after))
    assert g.tokens == results[0].notebook_len - kept
    for r in results[1:]:  # after a fire the notes are exact until a new skill is spliced
        g = r.decision.guard
        assert g.fired == (bool(r.tokens_reused) and g.tokens > 0)
        assert g.fired or g.tokens == 0
    # the decision was read from the exact recompute of the agent's own tokens
    nb = agent.notebook
    exact = engine.prefill(nb.token_ids)
    for l in range(nb.num_layers):
        assert torch.allclose(nb.keys(l), exact.keys(l), atol=1e-4)
    quiet = KvnotesAgent(engine, book, guard=0.0)  # no margin is below 0: never fires
    first = run_episode(quiet, episode.state, episode.turns[:1])[0]
    assert not first.decision.guard.fired and first.decision.guard.tokens == 0


def test_bench_reports_the_guard(engine, book, skill_root):
    result = run_bench(engine, scripted_episodes(1, 2), skill_root=skill_root, guard=1e9,
                       stale=False)
    g = result["guard"]
    assert g["fired"] == g["decisions"] == 2 and g["tokens"] > 0
    assert result["identity"] == 1.0  # every decision re-taken on exact notes
    assert "decision guard (tau = 1000000000.0) fired | 2 of 2" in report_markdown(result)
