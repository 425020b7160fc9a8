"""kvnotes on a real vLLM server (CPU build, .venv-vllm): the erratum keeps the prefix cache
aligned, and composition splices skills inside the server.

On the session's server (``vllm_launch``): SmolLM2 in float32 (kvnotes' own numerics, so spliced
output can be compared token for token with ``engine.compose``) with prefix caching on, blocks
of 32 tokens and kvnotes' connector loaded; requests without the splice salt are served exactly
as without kvnotes, so the erratum benchmark shares it. This module's spliced requests use a
tenant of its own and its skills are its own copies (``skill_copy``), so what other modules
leave in the server does not reach them. CI builds the vLLM environment (`make test` depends
on `make vllm`); elsewhere these tests skip only when that environment is absent.
"""

from __future__ import annotations

import math
import time
import uuid

import pytest
from conftest import skill_copy, wait_for_rescan

from kvnotes.apps.agent.prompt import HEADER
from kvnotes.core.repair import Repair
from kvnotes.serving.compose_client import ComposeClient, cold_salt
from kvnotes.serving.vllm_endpoints import Client
from kvnotes_bench.serving.erratum import ErratumBenchConfig, run_benchmark
from kvnotes_bench.serving.kit import ServerRecord

pytestmark = pytest.mark.vllm

OWNER = "server"  # this module's tenant, skill texts and skill names


def own_text(name: str) -> str:
    """This module's copy of the bundled skill ``name``."""
    return skill_copy(name, OWNER)


@pytest.fixture(scope="module")
def serving(vllm_launch):
    """``(server, skills)``: the session's vLLM server and its skill library, the system header
    registered."""
    server, skills = vllm_launch.server, vllm_launch.skills
    assert skills is not None
    skills.add(HEADER, name="header")
    return server, skills


USER = ("\n\nCustomer Mei Lin (booking C48213) writes: I booked 2 days ago and want to cancel. "
        "What do I get back?\nAgent:")


def test_erratum_keeps_vllm_prefix_cache_aligned(serving):
    server, _ = serving
    # the partly filled last block (up to 31 tokens) and the appended correction stay
    # uncached: 1500 tokens of context put the erratum's hit rate above 0.9 with a margin, and
    # both sessions stay in the server's small KV cache while their edits arrive
    config = ErratumBenchConfig(context_tokens=(1500,), field_depth=0.1, sessions=2, edits=2,
                         concurrency=(1,), policies=("in-place", "erratum"),
                         request_timeout_s=300, time_budget_s=900)
    result = run_benchmark(Client(server.url), config, log=print).to_dict()
    rows = {s["policy"]: s for s in result["summaries"]}
    for s in rows.values():  # every request succeeded
        assert s["failed"] == 0 and s["skipped"] == 0 and s["ok"] == s["requests"] == 4, s
    erratum, in_place = rows["erratum"], rows["in-place"]
    assert erratum["hit_rate"] > 0.9, erratum
    assert in_place["hit_rate"] < erratum["hit_rate"]
    assert erratum["ttft_p90_s"] < in_place["ttft_p90_s"], (erratum, in_place)
    assert erratum["agreement_n"] == 4


@pytest.fixture(scope="module")
def client(serving, smollm2):
    server, _ = serving
    return ComposeClient(server.url, server.served_name, smollm2.tokenizer, tenant=OWNER)


@pytest.mark.parametrize("order", [("refunds", "baggage"), ("baggage", "refunds")])
def test_spliced_output_equals_engine_compose(serving, client, smollm2, order):
    _, skills = serving
    texts = [own_text(name) for name in order]
    for name, text in zip(order, texts, strict=True):
        skills.add(text, name=f"{OWNER}-{name}")
    wait_for_rescan()
    parts = [HEADER, *texts, USER]
    got = client.complete(parts, max_tokens=16, logprobs=1)
    assert got.ok, got.error
    n_known = sum(len(smollm2.encode(t)) for t in (HEADER, *texts))
    assert got.cached_tokens == n_known  # header + both skills spliced, the user text computed
    nb = smollm2.compose([smollm2.compile(t, anchor="none") for t in (HEADER, *texts)] + [USER],
                         repair=0)  # the server's bare splice
    want = smollm2.greedy(nb, None, 16)
    assert got.text == want.text
    first = want.first_logits.log_softmax(-1)
    top = int(first.argmax())
    assert smollm2.decode([top]) == got.tokens[0]
    assert math.isclose(got.top_logprobs[0][got.tokens[0]], float(first[top]), abs_tol=0.02)


def test_anchored_skills_spliced_equal_engine_compose(serving, client, smollm2):
    """Skills compiled behind the header (``after=HEADER``): the server places each at its
    position in the prompt; the result equals kvnotes' own composition of the same skills."""
    _, skills = serving
    names = ("cancellation", "compensation")
    texts = [own_text(n) for n in names]
    for name, text in zip(names, texts, strict=True):
        skills.add(text, name=f"{OWNER}-{name}", after=HEADER)
    wait_for_rescan()
    parts = [HEADER, *texts[::-1], USER]
    got = client.complete(parts, max_tokens=16)
    assert got.ok, got.error
    assert got.cached_tokens == sum(len(smollm2.encode(t)) for t in (HEADER, *texts))
    nb = smollm2.compose([smollm2.compile(HEADER), *(smollm2.compile(t, after=HEADER)
                                                     for t in texts[::-1]), USER], repair=0)
    assert got.text == smollm2.greedy(nb, None, 16).text


def test_exact_requests_never_see_spliced_kv(serving, client):
    _, skills = serving
    texts = [own_text("insurance"), own_text("membership")]
    for text, name in zip(texts, ("insurance", "membership"), strict=True):
        skills.add(text, name=f"{OWNER}-{name}")
    wait_for_rescan()
    parts = [HEADER, *texts, USER]
    spliced = client.complete(parts, max_tokens=8, logprobs=5)  # first: these tokens are new
    # exact (a salt that is not a splice salt) in a namespace of its own: other modules' exact
    # requests that start with the header leave its first block in the shared prefix cache
    exact = client.complete(parts, max_tokens=8, logprobs=5, salt=f"{OWNER}-exact")
    cold = client.complete(parts, max_tokens=8, logprobs=5, salt=cold_salt())  # from scratch
    assert spliced.ok and exact.ok and cold.ok
    assert spliced.cached_tokens > 700 and exact.cached_tokens == 0  # nothing exact was cached
    assert exact.text == cold.text and exact.tokens == cold.tokens
    tok = cold.tokens[0]
    gap_exact = abs(exact.top_logprobs[0][tok] - cold.top_logprobs[0][tok])
    gap_spliced = abs(spliced.top_logprobs[0].get(tok, -99.0) - cold.top_logprobs[0][tok])
    assert gap_exact < 1e-3 < gap_spliced  # the exact answer is the computed one, not the splice


def test_unknown_lead_or_skill_after_text_is_computed(serving, client, smollm2):
    _, skills = serving
    text = own_text("escalation")
    skills.add(text, name=f"{OWNER}-escalation")
    wait_for_rescan()
    after_text = client.complete(["Some text nothing has cached. ", text, USER], max_tokens=1)
    assert after_text.ok and after_text.cached_tokens == 0  # a hole cannot be expressed
    unknown = client.complete(["A prompt of unregistered text only." + USER], max_tokens=1)
    assert unknown.ok and unknown.cached_tokens == 0


def test_skill_registered_while_running_is_used(serving, client, smollm2):
    _, skills = serving
    text = ("LOST ITEMS POLICY: items left on board are kept for 30 days at the arrival airport. "
            "Customers file a lost-item report online; agents never promise that an item will "
            "be found, and valuables are released only against photo identification.")
    skills.add(text, name=f"{OWNER}-lost-items")  # the server has been running all along
    time.sleep(1.0)  # the connector rescans its folder at most every 0.25 s
    got = client.complete([HEADER, text, USER], max_tokens=1)
    assert got.ok and got.cached_tokens == len(smollm2.encode(HEADER)) + len(smollm2.encode(text))


# ---- phased prefill: skills' first tokens computed in context by vLLM ----------------------------
PHASED = ("account_changes", "tools", "membership")


@pytest.fixture(scope="module")
def phased(serving, smollm2):
    """``(client, block size, parts)``: a client that plans repaired requests from the
    server's skills folder, and a prompt of the header and three skills compiled behind it."""
    server, skills = serving
    block = ServerRecord.read(Client(server.url), server.served_name).block_size
    assert block, "the server reports no block size"
    texts = [own_text(n) for n in PHASED]
    for name, text in zip(PHASED, texts, strict=True):
        skills.add(text, name=f"{OWNER}-{name}", after=HEADER)
    wait_for_rescan()
    client = ComposeClient(server.url, server.served_name, smollm2.tokenizer, tenant=OWNER,
                           skills=skills.folder, block_size=block)
    return client, block, [HEADER, *texts, USER]


def tenant_client(client: ComposeClient, tokenizer) -> ComposeClient:
    """The same server and skills under a tenant of its own: a prefix cache nothing shares."""
    assert client.store is not None
    return ComposeClient(client.url, client.model, tokenizer, tenant=f"t{uuid.uuid4().hex[:12]}",
                         skills=client.store.folder, block_size=client.block_size)


def test_a_phased_request_equals_engine_compose_with_the_same_repair(phased, smollm2):
    client, block, parts = phased
    got = tenant_client(client, smollm2.tokenizer).complete(parts, max_tokens=16,
                                                            repair=Repair(first=32))
    assert got.ok, got.error
    assert got.plan is not None
    plan = got.plan.to_dict()
    assert plan["repair"] == {"first": 32, "align": block, "share": 0.0,
                                               "skip_exact": True}
    # the header and the first skill (at their origins) are spliced whole; the other two skills'
    # first tokens are computed, each region ending on a block boundary, one phase each
    assert got.phases == 2 and got.phase_errors == 0
    assert all(r % block == 0 for r in plan["phase_ends"])
    chain_end = plan["ranges"][1][2]
    assert got.phase_cached_tokens[0] == chain_end  # the first phase: the chain, spliced
    n_known = sum(len(smollm2.encode(t)) for t in parts[:-1])
    assert got.cached_tokens == n_known  # phases' blocks + the rest of the last skill
    nb = smollm2.compose([smollm2.compile(HEADER),
                          *(smollm2.compile(t, after=HEADER) for t in parts[1:-1]), USER],
                         repair=Repair(first=32, align=block))
    assert [list(r) for r in nb.meta["compose"]["regions"]] == plan["regions"]
    assert got.text == smollm2.greedy(nb, None, 16).text


def test_repeats_reuse_their_phases(phased):
    client, _, parts = phased
    first = client.complete(parts, max_tokens=4, repair=Repair(first=32))
    again = client.complete(parts, max_tokens=4, repair=Repair(first=32))
    assert first.ok and again.ok, (first.error, again.error)
    assert again.text == first.text
    # each repeated phase is a local hit over its whole region (only its one extra token is
    # computed); the real request hits the first one's blocks, user text included
    assert again.plan is not None and again.phase_cached_tokens == list(again.plan.phase_ends)
    assert again.cached_tokens is not None and first.cached_tokens is not None
    assert again.prompt_tokens is not None and client.block_size is not None
    assert again.cached_tokens >= max(first.cached_tokens, again.prompt_tokens - client.block_size)


def test_a_request_whose_phases_are_missing_is_computed_correctly(phased, smollm2):
    """A tenant that never sent the phases: the connector finds no range at the later local
    hits and supplies only the chain from token 0; vLLM computes the rest in context."""
    client, _, parts = phased
    fresh = tenant_client(client, smollm2.tokenizer)
    ids, plan = fresh.plan(parts, Repair(first=32))
    got = fresh.send(plan.real_body(ids, fresh.model, max_tokens=16))
    assert got.ok, got.error
    assert got.cached_tokens == plan.ranges[1].end  # header + the first skill only
    # what the server did: the chain spliced exactly placed, the later skills computed as text
    nb = smollm2.compose([smollm2.compile(HEADER), smollm2.compile(parts[1], after=HEADER),
                          *parts[2:]], repair=0)
    assert got.text == smollm2.greedy(nb, None, 16).text


def test_the_guard_answers_a_close_call_exactly(phased):
    client, _, parts = phased
    exact = client.complete(parts, max_tokens=8, splice=False)
    never = client.complete(parts, max_tokens=8, repair=Repair(first=32), guard=0.0)
    always = client.complete(parts, max_tokens=8, repair=Repair(first=32), guard=1e6)
    assert exact.ok and never.ok and always.ok
    assert never.guard_fired is False and never.margin is not None and never.margin >= 0
    assert always.guard_fired is True and always.spliced_tokens == 0
    assert always.text == exact.text  # the answer came from the exact request
