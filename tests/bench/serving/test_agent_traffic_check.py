"""The agent soak's one engine reference per answer, on a tiny random model: the computation
the connector's reports describe (simulated with the connector's own planner over the bodies
the front's plan sends) is ``Engine.compose``'s, a failed load recomputes from there, and the
prompt is rendered from the chat template alone."""

from __future__ import annotations

import copy

import pytest
from conftest import make_tiny_engine

from kvnotes.core.repair import Repair
from kvnotes.serving.library.piece_store import PieceStore
from kvnotes.serving.planning.front_plan import FrontPlan, plan_request
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.planning.request import read_request
from kvnotes.serving.protocol import SpliceReport, SpliceRequest, UsageKvnotes
from kvnotes.serving.skills import ServingSkills
from kvnotes.serving.vllm.plans import SplicePlanner
from kvnotes_bench.serving.agent_traffic_check import (
    AgentOracle,
    KeptEntries,
    Reference,
    served_strings,
    verdict,
)
from kvnotes_bench.serving.agent_traffic_client import Answer
from kvnotes_bench.serving.agent_traffic_render import NotRendered, rendered_prompt
from kvnotes_bench.serving.agent_traffic_requests import AgentRequest

HEADER = "You are the airline's support agent. Follow the policies.\n"
BAGGAGE = "Baggage: one checked bag of 23 kg is included on every international fare.\n"
REFUNDS = "Refunds: a ticket cancelled within 24 hours of booking is refunded in full.\n"
USER = "Customer: can I get my money back?\nAgent:"
BLOCK = 4


@pytest.fixture(scope="module")
def published(tmp_path_factory, tokenizer):
    lib = ServingSkills(tmp_path_factory.mktemp("agent-skills"),
                        make_tiny_engine("llama", tokenizer))
    lib.add(HEADER, name="header")
    for name, text in (("refunds", REFUNDS), ("baggage", BAGGAGE)):
        lib.add(text, name=name, after=HEADER)
    return lib


def front_plan(published, tokenizer, first: int) -> FrontPlan:
    texts = [HEADER, BAGGAGE, REFUNDS, USER]  # the skills in another order than compiled
    req = read_request("completion", {"model": "m", "prompt": "".join(texts)}, tokenizer)
    return plan_request(req, SkillCatalog(published.folder, tokenizer),
                        Repair(first=first, align=BLOCK), BLOCK, None)


def served(published, fp: FrontPlan, fail_block: int | None = None) -> UsageKvnotes:
    """The ``usage.kvnotes`` the front would answer with: the connector's planner run over the
    phases and the real request as vLLM runs them (each phase's blocks the next one's local
    hit; block ``i`` holds tokens ``[i * BLOCK, (i + 1) * BLOCK)``), its reports collected;
    ``fail_block``: a block whose load fails in the real request."""
    index = PieceStore(published.folder).index
    planner = SplicePlanner(block_size=BLOCK)
    bodies = [*fp.plan.phase_bodies(fp.ids, "m"), fp.plan.real_body(fp.ids, "m")]
    reports: list[SpliceReport] = []
    for n, (hit, body) in enumerate(zip([0, *fp.plan.phase_ends], bodies, strict=True)):
        rid = f"r{n}"
        asked = SpliceRequest.from_params(body["kv_transfer_params"])
        ext = planner.match(rid, None, body["prompt"], hit, index, asked)
        planner.allocated(rid, list(range(len(fp.ids) // BLOCK + 1)), ext)
        planner.take({rid: 1})
        if fail_block is not None and n == len(bodies) - 1:
            planner.failed({fail_block})
        report = planner.finished(rid)
        assert report is not None
        reports.append(report)
    return UsageKvnotes(fp.plan.spliced_tokens, len(bodies) - 1, False, fp.wire(), None,
                        tuple(reports[:-1]), reports[-1])


def oracle_of(published) -> AgentOracle:
    return AgentOracle(published.engine, KeptEntries(published.folder,
                                                     published.manifest.fingerprint_obj))


def composition(published, first: int):
    lib = published.library
    parts = [lib.get(HEADER, name="header"), lib.get(BAGGAGE, name="baggage", after=HEADER),
             lib.get(REFUNDS, name="refunds", after=HEADER), USER]
    return published.engine.compose(parts, repair=Repair(first=first, align=BLOCK))


@pytest.mark.parametrize("first", [0, 8])
def test_the_one_reference_a_report_describes_is_engine_compose(published, tokenizer, first):
    fp = front_plan(published, tokenizer, first)
    usage = served(published, fp)
    assert usage.report is not None and usage.report.supplied > 0
    oracle = oracle_of(published)
    ref, foreign = oracle.reference(fp.ids, usage, 5)
    assert isinstance(ref, Reference) and ref.label == "reported" and foreign == 0
    engine = published.engine
    want = composition(published, first)
    assert want.token_ids.tolist() == fp.ids
    assert ref.ids == engine.greedy(want, None, 5).token_ids
    assert oracle.computed == 1  # one reference, no candidates tried
    exact, _ = oracle.reference(fp.ids, UsageKvnotes(exact="no_skill"), 5)
    assert isinstance(exact, Reference) and exact.label == "exact" and oracle.computed == 2
    assert exact.ids == engine.greedy(engine.prefill(fp.ids), None, 5).token_ids
    fired = UsageKvnotes(usage.spliced_tokens, usage.phases, True, usage.plan)
    assert oracle.reference(fp.ids, fired, 5)[0].label == "exact"  # the exact request answered


def test_a_failed_load_is_recomputed_from_its_first_failed_token(published, tokenizer):
    fp = front_plan(published, tokenizer, 8)
    clean = served(published, fp)
    assert clean.report is not None
    hit = clean.report.local_hit
    usage = served(published, fp, fail_block=hit // BLOCK + 1)
    assert usage.report is not None and usage.report.recompute_from == hit + BLOCK
    c = hit + BLOCK
    oracle = oracle_of(published)
    ref, _ = oracle.reference(fp.ids, usage, 5)
    engine = published.engine
    want = engine.greedy(composition(published, 8).slice(0, c), fp.ids[c:], 5).token_ids
    assert isinstance(ref, Reference) and ref.ids == want and oracle.computed == 1


def test_an_entry_that_was_not_kept_gives_no_reference(published, tokenizer, tmp_path):
    fp = front_plan(published, tokenizer, 0)
    usage = served(published, fp)
    oracle = AgentOracle(published.engine, KeptEntries(tmp_path, None))  # nothing kept
    why, _ = oracle.reference(fp.ids, usage, 3)
    assert isinstance(why, str) and why.endswith("was not kept") and oracle.computed == 0
    missing = UsageKvnotes(usage.spliced_tokens, usage.phases, False, usage.plan, None,
                           usage.phase_reports, None)  # a streamed answer: no report
    assert oracle.reference(fp.ids, missing, 3)[0] == ("the connector's reports are missing "
                                                       "(a streamed answer, or vLLM sent none)")


TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] }}
<tools>
{%- for tool in tools %}
{{- "\\n" }}{{- tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% else %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}{%- for message in messages[1:] %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"Do {name}.",
                                             "parameters": {"type": "object",
                                                            "properties": {}}}}


def test_the_prompt_is_rendered_from_the_chat_template_as_the_front_lays_it_out(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    request = AgentRequest("r", "tools", "You help travellers.", "Weather in Oslo?",
                           (tool("get_weather"), tool("book_taxi")))
    got = rendered_prompt(tok, request)
    front = read_request("chat", {"model": "m", **request.body()}, tok)
    assert got.ids == list(front.prompt_ids) and got.source == "template"
    # a front that rendered the tools in another order would send another prompt
    swapped = AgentRequest("r", "tools", request.system, request.question,
                           request.chunks[::-1])
    assert rendered_prompt(tok, swapped).ids != got.ids


@pytest.mark.parametrize("template", [None, "{% for m in messages %}{{ m.content }}{% endfor %}"],
                         ids=["no_template", "template_ignores_tools"])
def test_the_kvnotes_layouts_are_rendered_as_the_front_lays_them_out(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    for request in (AgentRequest("r", "tools", "You help travellers.", "Weather in Oslo?",
                                 (tool("get_weather"), tool("book_taxi"))),
                    AgentRequest("r", "tools", "", "Weather?", (tool("get_weather"),)),
                    AgentRequest("d", "documents", "Answer from the documents.", "Which is older?",
                                 ("The first document.", "The second document."))):
        got = rendered_prompt(tok, request)
        front = read_request("chat", {"model": "m", **request.body()}, tok)
        assert got.ids == list(front.prompt_ids), request
        assert got.source == ("default" if template is None else
                              "kvnotes_tools" if request.kind == "tools" else "template")
        assert got.stop == (("\n\nUser:",) if template is None else ())
    # the tool block's tools in another order are another prompt
    request = AgentRequest("r", "tools", "You help.", "Weather?", (tool("a"), tool("b")))
    swapped = AgentRequest("r", "tools", "You help.", "Weather?", (tool("b"), tool("a")))
    assert rendered_prompt(tok, request).ids != rendered_prompt(tok, swapped).ids


def test_a_template_that_fails_leaves_the_answer_unchecked(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{{ raise_exception('no system turns') }}"
    with pytest.raises(NotRendered, match="template failed"):
        rendered_prompt(tok, AgentRequest("r", "tools", "S", "Q", (tool("a"),)))


def test_a_korean_answer_is_compared_as_vllm_spells_its_byte_tokens(tokenizer):
    # recorded: SmolLM2 soak request 15 (2026-12-03), flagged wrong at its first token because
    # each engine id was decoded alone ("\ufffd") while vLLM spells an unfinished UTF-8
    # character "" and the whole character on the token that completes it
    ids = [183, 228, 114, 184, 223, 230, 46258, 184, 219, 122, 25947, 117, 230, 182, 237, 114]
    server = ["", "", "스", "", "", "테", "이", "", "", "크", "", "", " 만", "", "", "들"]
    assert served_strings(tokenizer, ids) == server
    assert [tokenizer.decode([t]) for t in ids] != server
    answer = Answer(ok=True, text="스테이크 만들", tokens=server, margins=[1.0] * 16,
                    finish_reason="length")
    v = verdict(answer, [Reference("exact", ids)], tokenizer, eos=[], tie_tau=0.05)
    assert v.status == "ok" and v.matched == "exact"
    other = [*ids[:6], 46258, 184, 219, 123, *ids[10:]]  # another third character
    v = verdict(answer, [Reference("exact", other)], tokenizer, eos=[], tie_tau=0.05)
    assert v.status == "wrong" and v.diverged_at == 9


def test_the_references_stop_where_the_server_stops(published, tmp_path):
    # the front sends a base model's chat with stop "\n\nUser:": vLLM ends the answer at the
    # token that completes it, and so must the reference (else it is longer than the answer)
    engine = published.engine
    ids = engine.tokens_of(HEADER + USER)[0]
    oracle = AgentOracle(engine, KeptEntries(tmp_path, None))
    whole = oracle.exact(ids, 8)
    assert len(whole.ids) == len(whole.margins) and all(m >= 0 for m in whole.margins)
    assert whole.ids == engine.greedy(engine.prefill(ids), None, 8).token_ids
    stop = engine.decode(whole.ids[:3])[-2:]
    cut = oracle.exact(ids, 8, (stop,))
    assert stop in engine.decode(cut.ids) and stop not in engine.decode(cut.ids[:-1])
    assert cut.ids == whole.ids[:len(cut.ids)] and len(cut.ids) <= 3
    assert cut.margins == whole.margins[:len(cut.ids)]


def test_prefix_cache_tokens_another_request_made_are_counted(published, tokenizer):
    """A first request whose local hit reaches past the plan's first spliced piece stands on
    another request's blocks: they are taken as the plan lays them out, and counted (a
    mismatch there is then unchecked, not wrong); the text before that piece is not counted
    (every request of the salt computes it alike)."""
    from dataclasses import replace

    from kvnotes_bench.serving.agent_traffic_check import reported_sources

    fp = front_plan(published, tokenizer, 8)
    usage = served(published, fp)
    assert reported_sources(len(fp.ids), usage)[1] == 0
    first = min(r.start for r in fp.plan.ranges if r.end - r.piece_start > 1)
    phase = usage.phase_reports[0]
    assert phase is not None
    hit = first + BLOCK
    early = replace(usage, phase_reports=(replace(phase, local_hit=hit), *usage.phase_reports[1:]))
    sources, foreign = reported_sources(len(fp.ids), early)
    assert foreign == hit - first
    # there, each token's notes are what the plan's own phases would have made
    def by_token(found):
        return {t: (s.key, s.piece_start) for s in found for t in range(s.start, s.end)
                if t < hit}

    clean = by_token(reported_sources(len(fp.ids), usage)[0])
    assert by_token(sources) == clean and any(k is not None for k, _ in clean.values())


def test_a_foreign_hit_is_taken_from_the_earliest_request_that_shares_it(published, tokenizer):
    """The tokens of a hit another request made come from the earliest earlier request of the
    same salt whose prompt shares them (its layout), the rest from this request's reports; with
    no such request, from the plan's layout."""
    from dataclasses import replace

    from kvnotes_bench.serving.agent_traffic_check import Source, clip, foreign_end

    fp = front_plan(published, tokenizer, 8)
    usage = served(published, fp)
    assert foreign_end(len(fp.ids), usage) == 0
    first = min(r.start for r in fp.plan.ranges if r.end - r.piece_start > 1)
    phase = usage.phase_reports[0]
    assert phase is not None
    hit = first + BLOCK
    early = replace(usage, phase_reports=(replace(phase, local_hit=hit), *usage.phase_reports[1:]))
    assert foreign_end(len(fp.ids), early) == hit
    assert clip([Source(0, 10), Source(10, 20, "k", 10)], 5, 12) == [
        Source(5, 10), Source(10, 12, "k", 10)]
    oracle = oracle_of(published)
    salt = usage.plan.salt
    donor = [Source(0, len(fp.ids))]  # an earlier request that computed the prompt whole
    oracle.layouts += [("another-salt", tuple(fp.ids), [Source(0, len(fp.ids), "x", 0)]),
                       (salt, tuple(fp.ids), donor)]
    assert oracle.donor(salt, fp.ids, hit) == (1, donor)
    assert oracle.donor(salt, [*fp.ids[:hit - 1], -1], hit) is None
    ref, foreign = oracle.reference(fp.ids, early, 2)
    assert foreign == hit - first and oracle.donor_index == 1
    assert oracle.layouts[-1][2][0] == Source(0, hit)  # the donor's, up to the hit
    assert ref == oracle.reference(fp.ids, early, 2)[0]
