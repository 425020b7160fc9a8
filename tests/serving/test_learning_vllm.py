"""Learned entries on the session's real vLLM server (``vllm_launch``): a chunk learned for one
tenant is spliced into that tenant's requests only, and once evicted it is computed, never
spliced from a file that is gone; the answers without it are the exact ones."""

from __future__ import annotations

import re

import pytest
from conftest import skill_copy, wait_for_rescan

from kvnotes.core.document import encode
from kvnotes.serving.compose_client import ComposeClient, cold_salt
from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning import Learner
from kvnotes.serving.library.manifest import splice_salt
from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.planning.layout import prompt_ids
from kvnotes.serving.planning.phases import completion_body
from kvnotes.serving.protocol import SpliceRequest

pytestmark = pytest.mark.vllm

OWNER = "learning"  # this module's texts and tenants
HEADER = f"You are the support agent of the {OWNER} desk. Answer in one short sentence.\n"
USER = "\n\nCustomer: my bag arrived torn. What do I do?\nAgent:"


def spliced_ranges(log: str, tenant: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(
        rf"\(tenant {re.escape(tenant)}\): spliced tokens \[(\d+), (\d+)\)", log)]


def test_a_learned_chunk_is_its_tenants_only_and_computed_once_evicted(vllm_launch, smollm2):
    launch = vllm_launch
    assert launch.skills is not None
    tok = smollm2.tokenizer
    text = skill_copy("baggage", OWNER)
    launch.skills.add(HEADER, name=f"{OWNER}-header")
    own = f"{OWNER}-a"
    learner = Learner(LearnConfig(after=1, min_tokens=4), launch.skills)
    learner.observe(own, [SeenChunk("content", text, tuple(encode(tok, text)),
                                    tuple(prompt_ids(tok, [HEADER])))])
    assert learner.run_pending() == 1
    (entry,) = [e for e in learner.registry.entries() if e.tenant == own]
    wait_for_rescan()
    url, name = launch.server.url, launch.server.served_name
    parts = [HEADER, text, USER]
    head, body = len(prompt_ids(tok, [HEADER])), len(encode(tok, text))

    def ask(tenant: str, tag: str) -> tuple[str, list[tuple[int, int]]]:
        start = launch.server.log_path.stat().st_size
        client = ComposeClient(url, name, tok, tenant=tenant)
        # the leading run under a tag of its own: a fresh prefix-cache namespace
        body = completion_body(client.prompt_ids(parts), name, max_tokens=16)
        body["cache_salt"] = splice_salt(tenant, tag=tag)
        body["kv_transfer_params"] = SpliceRequest.leading(tenant, tag).to_params()
        res = client.send(body)
        assert res.ok, res.error
        with open(launch.server.log_path, "rb") as f:
            f.seek(start)
            return res.text, spliced_ranges(f.read().decode("utf-8", "replace"), tenant)

    exact = ComposeClient(url, name, tok).complete(parts, max_tokens=16, salt=cold_salt())
    assert exact.ok, exact.error
    _, ranges = ask(own, "learned")
    assert ranges == [(0, head + body)]  # the header and the learned chunk
    other_text, ranges = ask(f"{OWNER}-b", "other")
    assert ranges == [(0, head)]  # the shared header only: never tenant a's entry
    assert other_text == exact.text
    assert learner.evict(entry.key)
    wait_for_rescan()
    evicted_text, ranges = ask(own, "evicted")  # a fresh prefix-cache namespace
    assert ranges == [(0, head)]
    assert evicted_text == exact.text
