"""kvnotes.apps.agent on a tiny random model: episodes end to end, append-only notebooks, the skill
library, tool-call validation and errors."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_engine
from typer.testing import CliRunner

from kvnotes.apps.agent import (
    FIELDS,
    AgentConfig,
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
from kvnotes.apps.agent.layout import common_prefix
from kvnotes.core.errors import (
    InvalidArgumentError,
    KvnotesError,
    UnknownFieldError,
    UnknownNameError,
)
from kvnotes.core.repair import Repair


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
    KvnotesAgent(engine, b).prepare()  # everything the (anchored) agent splices
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


def _close_to_prefill(engine, nb, upto: int) -> bool:
    """The notes of ``nb[:upto]`` equal a prefill of its tokens (up to float error)."""
    if not upto:
        return True
    exact = engine.prefill(nb.token_ids[:upto])
    return all(torch.allclose(nb.keys(l)[..., :upto, :], exact.keys(l), atol=1e-4)
               and torch.allclose(nb.values(l)[..., :upto, :], exact.values(l), atol=1e-4)
               for l in range(nb.num_layers))


def test_episode_end_to_end_reads_the_recompute_prompt_and_keeps_the_valid_prefix(engine, book):
    episode = scripted_episode(0, 4)
    assert any(t.events for t in episode.turns)
    agent = KvnotesAgent(engine, book)
    ref = RecomputeAgent(engine, book)
    agent.start(episode.state)
    ref.start(episode.state)
    previous = None
    for turn in episode.turns:
        result = agent.turn(turn.request, turn.events)
        ref.turn(turn.request, turn.events)
        assert result.decision.answer in turn.request.options
        assert set(result.decision.scores) == set(turn.request.options)
        assert result.tokens_computed > 0 and result.notebook_len == len(agent.notebook)
        # state changes are rewrites of the record: the very tokens the recompute agent reads
        assert torch.equal(agent.notebook.token_ids, ref.notebook.token_ids)
        assert torch.equal(agent.notebook.positions, ref.notebook.positions)
        # what the agent says is exact, is: equal to a prefill of the same tokens
        assert 0 < agent.exact <= len(agent.notebook)
        assert _close_to_prefill(engine, agent.notebook, agent.exact)
        if previous is not None:  # the kept prefix is the old notebook's, untouched
            same = common_prefix(previous.token_ids.tolist(), agent.notebook.token_ids.tolist())
            # a splice is kept whole or redone whole
            same = next((sp.start for sp in agent.notebook.spans
                         if sp.kind == "skill" and sp.start < same < sp.end), same)
            assert result.tokens_reused >= same
            assert _prefix(previous.slice(0, same).with_spans([]),
                           agent.notebook.slice(0, same).with_spans([]))
        previous = agent.notebook
    kinds = {s.kind for s in agent.notebook.spans}
    assert {"skill", "query", "text"} <= kinds and "erratum" not in kinds
    assert agent.state == episode.state.apply(e for t in episode.turns for e in t.events)
    record = agent.notebook.span("record")
    assert engine.decode(agent.notebook.token_ids[record.start:record.end]).startswith(
        agent.state.render())
    assert all(r.tokens_reused == 0 and r.tokens_computed == r.notebook_len for r in ref.turns)
    # the arithmetic: recompute's one forward over everything; kvnotes' share is what it fed
    assert all(r.flops == engine.cost.flops(r.notebook_len) for r in ref.turns)
    assert all(0 < a.flops < r.flops and a.guard_flops == 0
               for a, r in zip(agent.turns, ref.turns, strict=True))


def test_a_state_change_recomputes_from_the_changed_field_on(engine, book):
    state = scripted_episode(1).state.apply([Event("insurance", "none")])
    ask = request("add_bag", state)
    agent = KvnotesAgent(engine, book)
    agent.start(state)
    first = agent.turn(ask)
    record = agent.notebook.span("record")
    query = agent.notebook.span("t0.request")
    second = agent.turn(ask, [Event("insurance", "purchased")])
    # the same request and skills: kept up to the changed value, then the record's tail and
    # the request prefilled; the header and skills are reused, nothing is spliced again
    tail = len(engine.encode("- Travel insurance: purchased\n- Checked bags: "))
    assert second.tokens_computed < (record.end - record.start) // 2 + (query.end - query.start)
    assert second.tokens_computed <= tail + 30 + (query.end - query.start)
    assert second.tokens_reused >= record.start + (record.end - record.start) // 2
    assert first.tokens_computed > second.tokens_computed
    third = agent.turn(ask)  # the very same prompt: only its last token is fed again
    assert third.tokens_computed == 1 and third.tokens_reused == third.notebook_len - 1
    assert third.decision.scores == pytest.approx(second.decision.scores, abs=1e-4)


def test_errata_and_ignore_ablations_keep_the_first_record(engine, book):
    episode = scripted_episode(0, 3)
    changed = sum(len(t.events) for t in episode.turns[1:])
    assert changed
    errata = KvnotesAgent(engine, book, AgentConfig(updates="errata"))
    run_episode(errata, episode.state, episode.turns)
    spans = [s for s in errata.notebook.spans if s.kind == "erratum"]
    assert len(spans) == changed and all(".erratum." in s.name for s in spans)
    stale = KvnotesAgent(engine, book, AgentConfig(updates="ignore"))
    run_episode(stale, episode.state, episode.turns)
    for agent in (errata, stale):
        record = agent.notebook.span("record")
        text = engine.decode(agent.notebook.token_ids[record.start:record.end])
        assert text.startswith(episode.state.render())
    assert not [s for s in stale.notebook.spans if s.kind == "erratum"]
    with pytest.raises(UnknownNameError, match="unknown state update mode 'edit'"):
        KvnotesAgent(engine, book, AgentConfig(updates="edit"))


def test_history_and_skill_order_are_the_same_layout_for_both_agents(engine, book):
    episode = scripted_episode(0, 3)
    for history, kept in ((0, 0), (1, 1), (None, 2)):
        for order in ("request", "loaded", "appended"):
            a = KvnotesAgent(engine, book, AgentConfig(history=history, order=order))
            b = RecomputeAgent(engine, book, AgentConfig(history=history, order=order))
            run_episode(a, episode.state, episode.turns)
            run_episode(b, episode.state, episode.turns)
            assert torch.equal(a.notebook.token_ids, b.notebook.token_ids)
            past = [s for s in a.notebook.spans if s.kind == "query"][:-1]
            assert len(past) == kept
    last = episode.turns[2].request
    a = KvnotesAgent(engine, book, AgentConfig(order="loaded"))
    run_episode(a, episode.state, episode.turns)
    names = [s.name for s in a.notebook.spans if s.kind == "skill"]
    assert names[:3] == ["header", "tools", episode.turns[0].request.skills[0]]
    ordered = KvnotesAgent(engine, book)  # the request's own skills open the skill block
    run_episode(ordered, episode.state, episode.turns)
    names = [s.name for s in ordered.notebook.spans if s.kind == "skill"]
    assert names[2:2 + len(last.skills)] == list(last.skills)
    for bad in (-1, 1.5, True):
        with pytest.raises(KvnotesError, match="history must be a number of past exchanges"):
            KvnotesAgent(engine, book, AgentConfig(history=bad))
    with pytest.raises(UnknownNameError, match="unknown skill order 'random'"):
        RecomputeAgent(engine, book, AgentConfig(order="random"))


def test_repair_recomputes_the_first_tokens_of_inexact_splices(engine, book):
    episode = scripted_episode(0, 2)  # without variants every skill after the lead is inexact
    plain = run_episode(KvnotesAgent(engine, book, AgentConfig(variants=False)), episode.state,
                        episode.turns)
    fixed = KvnotesAgent(engine, book, AgentConfig(repair=4, variants=False))
    repaired = run_episode(fixed, episode.state, episode.turns)
    inexact = [s for s in fixed.notebook.spans if s.kind == "skill"][3:]  # after the lead
    assert inexact, "turn 2 must splice a skill that is not exact"
    assert repaired[1].tokens_computed == plain[1].tokens_computed + 4 * len(inexact)
    assert _close_to_prefill(engine, fixed.notebook, fixed.exact)
    chosen = KvnotesAgent(engine, book,
                          AgentConfig(repair=0.01, select="kv_deviation", variants=False))
    run_episode(chosen, episode.state, episode.turns)
    assert _close_to_prefill(engine, chosen.notebook, chosen.exact)
    with pytest.raises(UnknownNameError, match="unknown repair selector"):
        KvnotesAgent(engine, book, AgentConfig(select="best"))
    with pytest.raises(KvnotesError, match="repair"):
        KvnotesAgent(engine, book, AgentConfig(repair=-1))
    # an int is each skill's first tokens: a selector chooses a fraction's tokens only
    with pytest.raises(KvnotesError, match="give repair as a float in"):
        AgentConfig(repair=4, select="kv_deviation")
    assert AgentConfig(repair=0.1, select="kv_deviation").repair_plan == Repair(
        first=0, budget=0.1, select="kv_deviation")


def test_both_agents_read_the_same_tokens_and_decide_alike(engine, book):
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
    agent = KvnotesAgent(engine, book, AgentConfig(tool_calls=True, max_tool_tokens=8))
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
    # the layout and the guard as in agent-bench: the second request loads baggage after the
    # record, an inexact splice, so a guard this wide fires there
    result = CliRunner().invoke(app, ["agent", "--model", "tiny", "--skills-dir",
                                      str(skill_root), "--order", "appended", "--guard", "1e9"],
                                input="I need to cancel my trip\nCan I add a bag?\n")
    assert result.exit_code == 0, result.output
    assert result.output.count("decision: ") == 2
    assert result.output.count("guard: margin") == 1  # turn 0 is all exact: nothing to redo
    assert "re-decided on exact notes" in result.output
    result = CliRunner().invoke(app, ["agent", "--model", "tiny", "--skills-dir",
                                      str(skill_root), "--order", "bogus"], input="")
    assert result.exit_code != 0 and "unknown skill order 'bogus'" in result.output


def test_agent_skills_are_compiled_behind_their_true_prefix(engine, book):
    from kvnotes.apps.agent.prompt import Piece

    agent = KvnotesAgent(engine, book)
    head = engine.encode(agent.anchors.after)
    tools = agent.anchors.notes(Piece("skill", "tools", "tools"))
    assert tools.anchor == head and int(tools.notes.positions[0]) == len(head)  # behind the header
    assert not tools.compiled  # the book fixture compiled it
    refunds = agent.anchors.notes(Piece("skill", "refunds", "refunds"))
    assert refunds.anchor == head + book.token_ids("tools")  # behind the header and tools
    assert int(refunds.notes.positions[0]) == len(refunds.anchor)
    plain = KvnotesAgent(engine, book, AgentConfig(anchored=False))
    assert plain.anchors.after is None and int(book.notes("refunds").positions[0]) == 0
    # the lead (header, tools, the request's own skills) is spliced exactly where compiled:
    # nothing in turn 0 needs recomputing
    state = scripted_episode(0).state
    first = agent.turn(request("cancel", state)) if agent.start(state) is None else None
    assert agent.exact == first.notebook_len
    assert first.tokens_computed == len(agent.notebook) - agent.notebook.span("record").start


def test_guard_fires_only_on_inexact_notes_and_then_equals_recompute(engine, book):
    episode = scripted_episode(0, 3)
    agent = KvnotesAgent(engine, book, AgentConfig(guard=1e9))  # every margin is below it
    ref = RecomputeAgent(engine, book)
    results = run_episode(agent, episode.state, episode.turns)
    reference = run_episode(ref, episode.state, episode.turns)
    g = results[0].decision.guard  # turn 0: header, tools and the request's skills are exact
    assert g is not None and not g.fired and g.tokens == 0
    assert results[0].to_dict()["guard"]["fired"] is False
    fired = [r for r in results if r.decision.guard.fired]
    assert fired, "a later turn keeps a skill of an earlier request: inexact, the guard fires"
    for r in fired:
        lead = [s for s in agent.notebook.spans if s.kind == "skill"]
        assert 0 < r.decision.guard.tokens < r.notebook_len - sum(
            s.end - s.start for s in lead[:2])  # never the header or tools again
    for r, x in zip(results, reference, strict=True):  # every decision is recompute's own
        assert r.decision.answer == x.decision.answer
        for option, score in x.decision.scores.items():
            assert r.decision.scores[option] == pytest.approx(score, abs=1e-3)
    assert agent.exact == len(agent.notebook)
    assert _close_to_prefill(engine, agent.notebook, len(agent.notebook))
    quiet = KvnotesAgent(engine, book, AgentConfig(guard=0.0))  # no margin is below 0: never fires
    run_episode(quiet, episode.state, episode.turns)
    assert not any(t.decision.guard.fired or t.decision.guard.tokens for t in quiet.turns)


def test_prepare_covers_the_loaded_order_too(engine, tmp_path):
    """With order="loaded" turn 0 opens with the same lead as "request" order (header, tools,
    the request's skills): prepare compiles it, so no turn compiles and turn 0 is exact."""
    book = SkillBook(engine, tmp_path)
    agent = KvnotesAgent(engine, book, AgentConfig(order="loaded"))
    calls = []
    compiled = agent.prepare(progress=lambda *call: calls.append(call))
    misses = book.library.misses
    assert [c[:2] for c in calls] == [(i, len(calls)) for i in range(1, len(calls) + 1)]
    assert compiled == misses == sum(c[3] for c in calls) > 0  # a fresh library: all compiled
    assert agent.prepare() == 0 and book.library.misses == misses  # then all loaded
    state = scripted_episode(0).state
    agent.start(state)
    first = agent.turn(request("cancel", state))
    assert book.library.misses == misses
    assert agent.exact == first.notebook_len


def test_appended_layout_loads_skills_after_the_record(engine, tmp_path):
    """order="appended": turn 0's skills open the system block, the record follows, skills
    loaded later come after it (compiled behind everything that opens the block) and the block
    closes last. Loading a skill then re-prefills nothing: only the close and the request."""
    book = SkillBook(engine, tmp_path)
    agent = KvnotesAgent(engine, book, AgentConfig(order="appended"))
    agent.prepare()
    misses = book.library.misses
    ref = RecomputeAgent(engine, book, AgentConfig(order="appended"))
    guarded_agent = KvnotesAgent(engine, book, AgentConfig(order="appended", guard=1e9))
    state = scripted_episode(1).state
    turns = [Turn(request(k, state)) for k in ("cancel", "add_bag", "compensation")]
    for a in (agent, ref, guarded_agent):
        a.start(state)
    for t in turns:
        fast, exact, slow = agent.turn(t.request), guarded_agent.turn(t.request), ref.turn(t.request)
        assert torch.equal(agent.notebook.token_ids, ref.notebook.token_ids)
        for option, score in slow.decision.scores.items():  # the guard re-decides exactly
            assert exact.decision.scores[option] == pytest.approx(score, abs=1e-3)
        assert fast.decision.answer in t.request.options
    assert book.library.misses == misses  # prepare compiled every later skill's anchor
    nb = agent.notebook
    names = [s.name for s in nb.spans if s.name != "bos"]
    record = names.index("record")
    assert names[:record] == ["header", "tools", "cancellation", "refunds"]
    assert names[record + 1:] == ["baggage", "compensation", "system.end", "t2.request"]
    close, query = nb.span("system.end"), nb.span("t2.request")
    assert agent.turns[2].tokens_computed == (close.end - close.start) + (query.end - query.start)
    opening = nb.token_ids[:nb.span("record").start].tolist()
    later = book.notes("compensation", after=opening)  # what was spliced: compiled behind that
    assert book.library.misses == misses and int(later.positions[0]) == len(opening)
    assert agent.exact == nb.span("baggage").start  # exact up to the first later skill
    assert _close_to_prefill(engine, nb, agent.exact)
    assert _close_to_prefill(engine, guarded_agent.notebook, len(guarded_agent.notebook))


def test_other_skills_are_compiled_behind_the_lead_of_the_request_layout(engine, tmp_path):
    """order="request" (the default): the request's own skills open the skill block, exactly;
    with variants every other skill is compiled behind that lead, so the first one splices
    exactly too and a second misses only the first. variants=False: behind header and tools."""
    book = SkillBook(engine, tmp_path)
    agent = KvnotesAgent(engine, book)
    plain = KvnotesAgent(engine, book, AgentConfig(variants=False))
    assert agent.prepare() > plain.prepare() == 0  # plain's entries are a subset
    misses = book.library.misses
    ref = RecomputeAgent(engine, book)
    state = scripted_episode(1).state
    turns = [Turn(request(k, state)) for k in ("cancel", "add_bag")]
    for a in (agent, plain, ref):
        a.start(state)
        for t in turns:
            a.turn(t.request)
    assert book.library.misses == misses  # prepare compiled every variant
    nb = agent.notebook
    assert torch.equal(nb.token_ids, ref.notebook.token_ids)
    names = [s.name for s in nb.spans if s.kind == "skill"]
    assert names == ["header", "tools", "baggage", "cancellation", "refunds"]
    lead = nb.token_ids[:nb.span("cancellation").start].tolist()  # header, tools, baggage
    assert agent.exact == nb.span("refunds").start  # cancellation sits where it was compiled
    assert _close_to_prefill(engine, nb, agent.exact)
    refunds = book.notes("refunds", after=lead)
    assert book.library.misses == misses and int(refunds.positions[0]) == len(lead)
    assert plain.exact == plain.notebook.span("cancellation").start


def test_loaded_layout_compiles_later_skills_behind_the_opening(engine, tmp_path):
    """order="loaded": skills loaded after turn 0 follow turn 0's skills and precede the record;
    each is compiled behind that opening (the same variants as the appended layout), so the
    first one splices exactly and only a second one misses the first."""
    book = SkillBook(engine, tmp_path)
    # the record prefilled again behind the new skill, so every note can be exact
    agent = KvnotesAgent(engine, book, AgentConfig(order="loaded", carry_record=False))
    agent.prepare()
    misses = book.library.misses
    ref = RecomputeAgent(engine, book, AgentConfig(order="loaded"))
    state = scripted_episode(1).state
    turns = [Turn(request(k, state)) for k in ("cancel", "add_bag", "compensation")]
    for a in (agent, ref):
        a.start(state)
    for i, t in enumerate(turns):
        fast, slow = agent.turn(t.request), ref.turn(t.request)
        assert torch.equal(agent.notebook.token_ids, ref.notebook.token_ids)
        if i < 2:  # turn 0's skills, then one later skill right behind them: all exact
            assert agent.exact == len(agent.notebook)
            for option, score in slow.decision.scores.items():
                assert fast.decision.scores[option] == pytest.approx(score, abs=1e-3)
    assert book.library.misses == misses  # prepare compiled every later skill's anchor
    nb = agent.notebook
    names = [s.name for s in nb.spans if s.name != "bos"]
    assert names[:names.index("record")] == ["header", "tools", "cancellation", "refunds",
                                             "baggage", "compensation"]
    opening = nb.token_ids[:nb.span("baggage").start].tolist()
    later = book.notes("compensation", after=opening)  # the second later skill: behind the opening
    assert book.library.misses == misses and int(later.positions[0]) == len(opening)
    assert agent.exact == nb.span("compensation").start
    assert _close_to_prefill(engine, nb, agent.exact)


def test_carry_record_splices_the_last_turns_record_notes(engine, book):
    """carry_record: when the skills before the record change, its last-turn notes are
    re-rotated and spliced (same values, keys moved), only the request is fed, the prompt is
    still the recompute agent's, and the notes from the record on are no longer called exact."""
    state = scripted_episode(1).state
    asks = [request(k, state) for k in ("cancel", "add_bag")]  # add_bag reorders the skills
    carry = KvnotesAgent(engine, book)  # carry_record is the default
    plain = KvnotesAgent(engine, book, AgentConfig(carry_record=False))
    ref = RecomputeAgent(engine, book)
    for a in (carry, plain, ref):
        a.start(state)
    rows = []
    for ask in asks:
        old_nb = carry.notebook
        rows.append([a.turn(ask) for a in (carry, plain, ref)])
    assert rows[0][0].tokens_computed == rows[0][1].tokens_computed  # turn 0: nothing to carry
    second = rows[1][0]
    nb = carry.notebook
    assert torch.equal(nb.token_ids, ref.notebook.token_ids)
    assert torch.equal(nb.positions, ref.notebook.positions)
    old, new = old_nb.span("record"), nb.span("record")
    assert new.start != old.start  # the record moved: baggage now opens the skill block
    query = nb.span("t1.request")
    assert second.tokens_computed == query.end - query.start  # the request alone was fed
    assert second.tokens_reused == second.notebook_len - second.tokens_computed  # carried too
    assert rows[1][1].tokens_computed == query.end - query.start + new.end - new.start
    for l in range(nb.num_layers):  # spliced: the very values, keys re-rotated to the new place
        assert torch.equal(nb.values(l)[..., new.start:new.end, :],
                           old_nb.values(l)[..., old.start:old.end, :])
    assert carry.exact <= new.start and _close_to_prefill(engine, nb, carry.exact)
    moved = old_nb.slice(old.start, old.end).shifted(new.start - old.start)
    assert all(torch.allclose(nb.keys(l)[..., new.start:new.end, :], moved.keys(l), atol=1e-5)
               for l in range(nb.num_layers))
    # a state change rewrites the record's tail: the shared head is carried, the rest fed
    third = carry.turn(asks[0], [Event("checked_bags", "4")])
    record = carry.notebook.span("record")
    request_tokens = carry.notebook.span("t2.request")
    fed = third.tokens_computed - (request_tokens.end - request_tokens.start)
    assert 0 < fed < (record.end - record.start) // 2
    ref.turn(asks[0], [Event("checked_bags", "4")])
    assert torch.equal(carry.notebook.token_ids, ref.notebook.token_ids)


def test_carry_record_with_the_guard_still_decides_as_recompute(engine, book):
    episode = scripted_episode(0, 3)
    agent = KvnotesAgent(engine, book, AgentConfig(guard=1e9, carry_record=True))
    results = run_episode(agent, episode.state, episode.turns)
    reference = run_episode(RecomputeAgent(engine, book), episode.state, episode.turns)
    assert any(r.decision.guard.fired for r in results[1:])
    for r, x in zip(results, reference, strict=True):
        assert r.decision.answer == x.decision.answer
        for option, score in x.decision.scores.items():
            assert r.decision.scores[option] == pytest.approx(score, abs=1e-3)
    assert agent.exact == len(agent.notebook)
    assert _close_to_prefill(engine, agent.notebook, len(agent.notebook))
    with pytest.raises(KvnotesError, match="carry_record must be True or False"):
        KvnotesAgent(engine, book, AgentConfig(carry_record="record"))


def test_agent_config_checks_every_field(engine, book):
    assert AgentConfig().uses_variants and not AgentConfig(anchored=False).uses_variants
    with pytest.raises(InvalidArgumentError, match=r"^guard must be a margin >= 0 \(log-prob\)"):
        AgentConfig(guard=-1.0)
    with pytest.raises(InvalidArgumentError, match="^max_tool_tokens must be >= 1, got 0$"):
        AgentConfig(max_tool_tokens=0)
    with pytest.raises(KvnotesError, match="^tool_calls must be True or False, got 'yes'$"):
        AgentConfig(tool_calls="yes")
    with pytest.raises(UnknownNameError, match="^unknown erratum template 'nonsense'"):
        AgentConfig(erratum_template="nonsense")
    with pytest.raises(InvalidArgumentError, match="^select_layer must be >= 0, got -1$"):
        AgentConfig(select_layer=-1)
    with pytest.raises(KvnotesError, match="^config must be an AgentConfig, got dict"):
        KvnotesAgent(engine, book, {"guard": 1.0})
