"""A learning front whose compiles are the server's own prefill, on the session's real vLLM
server (``vllm_launch``): a tool seen twice in chats is compiled by vLLM (the connector saves
it), the third chat splices it, and its answer is the one the same ids give computed exactly
(``splice: false``)."""

from __future__ import annotations

import httpx2
import pytest
from conftest import wait_for_rescan

from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning import Learner
from kvnotes.serving.learning.compiles import VllmCompiler
from kvnotes.serving.library.registry import LearnedRegistry
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.server_prefill import EntryAddress, VllmPrefill

pytestmark = pytest.mark.vllm

OWNER = "vcfront"  # this module's tenant
LOOKUP = {"type": "function", "function": {
    "name": "lookup_booking",
    "description": ("Looks a booking up by its six-letter code and returns the passenger's "
                    f"name, the flights with their dates, times and seats ({OWNER}), the fare "
                    "class, the checked bags allowed, whether the ticket can still be "
                    "refunded in full, and any open request about meals or assistance."),
    "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "description": "the six-letter booking code"}},
        "required": ["code"]}}}
MESSAGES = [{"role": "system", "content": "You are the assistant of Fjord Air."},
            {"role": "user", "content": "Can I get my booking ABCDEF refunded?"}]


def test_a_tool_seen_twice_is_compiled_by_vllm_and_spliced_as_computed(vllm_launch, smollm2):
    launch = vllm_launch
    assert launch.skills is not None
    folder = launch.skills.folder
    registry = LearnedRegistry(folder)
    compiler = VllmCompiler(folder, registry, EntryAddress.of(launch.skills.manifest),
                            VllmPrefill(launch.server.url, launch.server.served_name))
    learner = Learner(LearnConfig(after=2, min_tokens=16), launch.skills, registry,
                      compiler=compiler)
    catalog = SkillCatalog(folder, smollm2.tokenizer)
    name = launch.server.served_name

    def chat(front: Front, **opts: object) -> dict:
        body = {"model": name, "messages": MESSAGES, "tools": [LOOKUP], "max_tokens": 8,
                "temperature": 0, "kvnotes": {"tenant": OWNER, **opts}}
        resp = httpx2.post(front.url + "/v1/chat/completions", json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    with Front(FrontConfig(upstream=launch.server.url), catalog, learner) as front:
        for _ in range(2):
            assert chat(front)["usage"]["kvnotes"]["spliced_tokens"] == 0
        assert learner.wait_idle(600)
        counters = learner.counters()
        assert counters["compiles"] == 1 and counters["failures"] == 0, counters
        (entry,) = [e for e in registry.entries() if e.tenant == OWNER]
        assert entry.kind == "tool"
        wait_for_rescan()
        got = chat(front)
        # the tool spliced (its first tokens may be repaired in context: the front's plan)
        assert got["usage"]["kvnotes"]["spliced_tokens"] > 0
        exact = chat(front, splice=False)
    assert exact["usage"]["kvnotes"]["exact"] == "opted_out"
    spliced = got["choices"][0]["message"]
    unspliced = exact["choices"][0]["message"]
    assert (spliced.get("content"), spliced.get("tool_calls")) == (
        unspliced.get("content"), unspliced.get("tool_calls"))
