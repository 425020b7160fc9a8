"""A learned variant on the session's real vLLM server (``vllm_launch``), through a front that
learns: a skill seen behind the same predecessor ``after`` times is compiled behind it in the
background; the next request in that order splices it exactly placed (nothing of it repaired)
and answers what the same token ids answer computed exactly (``splice: false``)."""

from __future__ import annotations

import httpx2
import pytest
from conftest import skill_copy, wait_for_rescan

from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning import Learner
from kvnotes.serving.planning.layout import prompt_ids
from kvnotes.serving.planning.match import SkillCatalog

pytestmark = pytest.mark.vllm

OWNER = "learnvar"  # this module's texts and tenant
HEADER = f"You are the support agent of the {OWNER} desk. Answer in one short sentence.\n"
USER = "\n\nCustomer: my bag arrived torn. What do I do?\nAgent:"


def test_a_pair_seen_twice_is_learned_and_then_spliced_exactly_placed(vllm_launch, smollm2):
    launch = vllm_launch
    assert launch.skills is not None
    tok = smollm2.tokenizer
    pred, skill = skill_copy("refunds", OWNER), skill_copy("baggage", OWNER)
    launch.skills.add(HEADER, name=f"{OWNER}-header")
    launch.skills.add(pred, name=f"{OWNER}-refunds", after=HEADER)
    launch.skills.add(skill, name=f"{OWNER}-baggage", after=HEADER)
    wait_for_rescan()
    start = len(prompt_ids(tok, [HEADER, pred]))  # the skill's first token in the prompt
    learner = Learner(LearnConfig(after=2, min_tokens=4), launch.skills)
    catalog = SkillCatalog(launch.skills.folder, tok)
    prompt = HEADER + pred + skill + USER
    name = launch.server.served_name

    def ask(front: Front, **opts: object) -> dict:
        body = {"model": name, "prompt": prompt,
                "max_tokens": 16, "temperature": 0, "kvnotes": {"tenant": OWNER, **opts}}
        resp = httpx2.post(front.url + "/v1/completions", json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    with Front(FrontConfig(upstream=launch.server.url), catalog, learner) as front:
        for _ in range(2):
            plan = ask(front)["usage"]["kvnotes"]["plan"]
            assert f"{OWNER}-baggage" not in plan["exactly_placed"]
            assert any(a <= start < b for a, b in plan["regions"])  # its first tokens repaired
        assert learner.wait_idle(600)
        (entry,) = learner.registry.entries()
        assert (entry.variant_of, entry.behind, entry.tenant) == (
            f"{OWNER}-baggage", f"{OWNER}-refunds", OWNER)
        wait_for_rescan()
        # another repair tag: a prefix-cache namespace of its own, so the server loads the
        # variant rather than the blocks the first two requests left
        got = ask(front, repair=64)
        plan = got["usage"]["kvnotes"]["plan"]
        assert f"{OWNER}-baggage" in plan["exactly_placed"]
        assert not any(a <= start < b for a, b in plan["regions"])  # nothing of it repaired
        assert got["usage"]["kvnotes"]["spliced_tokens"] > start
        # the same text computed exactly: the front sends the same part-wise ids unspliced
        ids = prompt_ids(tok, [HEADER, pred, skill, USER])
        assert len(ids) == plan["prompt_len"]
        exact = ask(front, splice=False)
    assert exact["usage"]["kvnotes"]["exact"] == "opted_out"
    assert exact["usage"]["prompt_tokens"] == len(ids)
    assert learner.counters()["variant_compiles"] == 1
    spliced, unspliced = got["choices"][0]["text"], exact["choices"][0]["text"]
    # every entry of the chain sits behind the very ids it was compiled behind: the spliced KV
    # are the full prefill's of the same ids, and the connector loads the entries the front
    # planned (their keys travel with the ranges) or computes them
    assert spliced == unspliced
