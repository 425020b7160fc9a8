"""Chunks compiled by the session's real vLLM server (``vllm_launch``: SmolLM2 float32, CPU):
the connector saves a compile request's KV from its blocks, the entry holds the numerics of
kvnotes' engine, spliced it answers as the exact prompt, and a compile that cannot finish or
cannot be written leaves no entry.

Each test keeps its entries apart from other modules' with a tenant of its own (the tenant is
part of an entry's key)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import skill_copy, wait_for_rescan

from kvnotes.core.document import encode
from kvnotes.core.positions.rope import rotate_keys
from kvnotes.serving.compose_client import ComposeClient, cold_salt
from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning import Learner
from kvnotes.serving.learning.compiles import VllmCompiler
from kvnotes.serving.library.manifest import ENTRY_SUFFIX, read_entry, splice_salt
from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.planning.layout import prompt_ids
from kvnotes.serving.planning.phases import completion_body
from kvnotes.serving.protocol import SaveRequest, SpliceRequest
from kvnotes.serving.server_prefill import EntryAddress, VllmPrefill

pytestmark = pytest.mark.vllm

OWNER = "vcompile"  # this module's texts and tenants
HEADER = f"You are the support agent of the {OWNER} desk. Answer in one short sentence.\n"
USER = "\n\nCustomer: my bag arrived torn. What do I do?\nAgent:"
# float32 on both sides, different kernels (vLLM's CPU attention vs transformers' SDPA)
KV_TOL = 2e-3


def compile_by_vllm(launch, tokenizer, tenant: str, lead_text: str = HEADER,
                    text: str | None = None):
    """The entry vLLM saves for the bundled baggage skill behind ``lead_text``."""
    text = text or skill_copy("baggage", OWNER)
    lead = prompt_ids(tokenizer, [lead_text])
    ids = encode(tokenizer, text)
    address = EntryAddress.of(launch.skills.manifest)
    key = address.key(ids, lead, tenant)
    prefill = VllmPrefill(launch.server.url, launch.server.served_name)
    t0 = time.perf_counter()
    prefill.prefill([*lead, *ids], SaveRequest(key, len(lead), len(lead) + len(ids), "baggage",
                                               tenant))
    took = time.perf_counter() - t0
    path = launch.skills.folder / f"{key}{ENTRY_SUFFIX}"
    assert path.is_file(), f"no entry saved for {key}"
    return path, lead, ids, text, took


def test_an_entry_compiled_by_vllm_holds_the_engines_numerics(vllm_launch, smollm2):
    launch = vllm_launch
    path, lead, ids, text, took = compile_by_vllm(launch, smollm2.tokenizer, f"{OWNER}-a")
    info, keys, values = read_entry(path, launch.skills.manifest.fingerprint_obj)
    assert info.token_ids == tuple(ids) and info.origin == len(lead) and info.behind == tuple(lead)
    nb = smollm2.compile(text, name="baggage", after=lead)
    assert nb.positions.tolist() == list(range(len(lead), len(lead) + len(ids)))
    worst_k = max(float((keys[l] - nb.keys(l)[0].transpose(0, 1)).abs().max())
                  for l in range(len(nb.layers)))
    worst_v = max(float((values[l] - nb.values(l)[0].transpose(0, 1)).abs().max())
                  for l in range(len(nb.layers)))
    print(f"vLLM vs engine entry, {len(ids)} tokens behind {len(lead)}: max |dk| {worst_k:.2e}, "
          f"max |dv| {worst_v:.2e}; compile request {took:.2f} s")
    assert worst_k < KV_TOL and worst_v < KV_TOL


def test_prefix_cache_hits_are_saved_too(vllm_launch, smollm2):
    """The same prompt compiled again (its blocks all prefix-cache hits but the last token's)
    saves the same KV: it is read from the blocks, not from the forward's own keys."""
    launch = vllm_launch
    first, *_ = compile_by_vllm(launch, smollm2.tokenizer, f"{OWNER}-b")
    again, *_ = compile_by_vllm(launch, smollm2.tokenizer, f"{OWNER}-c")
    fp = launch.skills.manifest.fingerprint_obj
    (_, k1, v1), (_, k2, v2) = read_entry(first, fp), read_entry(again, fp)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_reentry_moved_equals_vllms_keys_at_the_new_position(vllm_launch, smollm2):
    """Layer 0's keys depend on the token and its position only: an entry compiled at one
    offset and re-rotated to another equals what vLLM computed there."""
    launch = vllm_launch
    tok = smollm2.tokenizer
    near, lead, *_ = compile_by_vllm(launch, tok, f"{OWNER}-d")
    far, far_lead, *_ = compile_by_vllm(launch, tok, f"{OWNER}-d",
                                        lead_text=HEADER + "Be kind and precise.\n" * 4)
    fp, manifest = launch.skills.manifest.fingerprint_obj, launch.skills.manifest
    (_, k_near, v_near), (_, k_far, v_far) = read_entry(near, fp), read_entry(far, fp)
    delta = len(far_lead) - len(lead)
    assert delta > 0
    moved = rotate_keys(k_near[0].transpose(0, 1)[None], manifest.inv_freq(0), delta)
    err = float((moved[0].transpose(0, 1) - k_far[0]).abs().max())
    scale = float(k_far[0].abs().max())
    print(f"layer 0 keys moved by {delta}: max |dk| {err:.2e} (keys up to {scale:.1f})")
    assert err < 1e-5 * max(1.0, scale) * 4  # a few float32 roundings of the largest key
    assert float((v_near[0] - v_far[0]).abs().max()) < 1e-5


def test_a_vllm_compiled_chunk_spliced_answers_as_the_exact_prompt(vllm_launch, smollm2):
    launch = vllm_launch
    tok = smollm2.tokenizer
    tenant = f"{OWNER}-e"
    launch.skills.add(HEADER, name=f"{OWNER}-header")
    text = skill_copy("baggage", OWNER)
    learner = Learner(LearnConfig(after=1, min_tokens=4), launch.skills,
                      compiler=vllm_compiler(launch))
    learner.observe(tenant, [SeenChunk("content", text, tuple(encode(tok, text)),
                                       tuple(prompt_ids(tok, [HEADER])))])
    assert learner.run_pending() == 1
    assert learner.counters()["compiles"] == 1, learner.counters()
    (entry,) = [e for e in learner.registry.entries() if e.tenant == tenant]
    assert (launch.skills.folder / f"{entry.key}{ENTRY_SUFFIX}").is_file()
    wait_for_rescan()
    url, name = launch.server.url, launch.server.served_name
    client = ComposeClient(url, name, tok, tenant=tenant)
    parts = [HEADER, text, USER]
    body = completion_body(client.prompt_ids(parts), name, max_tokens=1)
    body["cache_salt"] = splice_salt(tenant, tag="vc")
    body["kv_transfer_params"] = SpliceRequest.leading(tenant, "vc").to_params()
    start = launch.server.log_path.stat().st_size
    got = client.send(body)
    assert got.ok, got.error
    with open(launch.server.log_path, "rb") as f:
        f.seek(start)
        log = f.read().decode("utf-8", "replace")
    head, n = len(prompt_ids(tok, [HEADER])), len(encode(tok, text))
    assert f"(tenant {tenant}): spliced tokens [0, {head + n})" in log
    exact = ComposeClient(url, name, tok).complete(parts, max_tokens=1, salt=cold_salt())
    assert exact.ok, exact.error
    assert got.text == exact.text


def vllm_compiler(launch, client=None) -> VllmCompiler:
    return VllmCompiler(launch.skills.folder, _registry(launch),
                        EntryAddress.of(launch.skills.manifest),
                        client or VllmPrefill(launch.server.url, launch.server.served_name))


def _registry(launch):
    from kvnotes.serving.library.registry import LearnedRegistry

    return LearnedRegistry(launch.skills.folder)


def test_a_compile_that_cannot_be_saved_leaves_no_entry_and_is_counted(vllm_launch, smollm2):
    """A directory where the entry's file would go: the worker cannot write it, the server
    goes on, the learner counts a failure and the chunk stays uncompiled."""
    launch = vllm_launch
    tok = smollm2.tokenizer
    tenant = f"{OWNER}-f"
    text = skill_copy("refunds", OWNER)
    address = EntryAddress.of(launch.skills.manifest)
    lead = prompt_ids(tok, [HEADER])
    key = address.key(encode(tok, text), lead, tenant)
    blocker = launch.skills.folder / f"{key}{ENTRY_SUFFIX}"
    blocker.mkdir()
    try:
        learner = Learner(LearnConfig(after=1, min_tokens=4), launch.skills,
                          compiler=vllm_compiler(launch))
        learner.observe(tenant, [SeenChunk("content", text, tuple(encode(tok, text)),
                                           tuple(lead))])
        assert learner.run_pending() == 1
        counters = learner.counters()
        assert counters["failures"] == 1 and counters["compiles"] == 0, counters
        assert not [e for e in learner.registry.entries() if e.tenant == tenant]
        assert blocker.is_dir() and not any(blocker.iterdir())
    finally:
        blocker.rmdir()
    assert not blocker.exists()


def test_a_save_request_the_connector_refuses_saves_nothing(vllm_launch, smollm2):
    """A range past the prompt: the request is served as it is and nothing is saved (aborts
    and failures before the range is computed: tests/serving/test_vllm_compile_units.py)."""
    launch = vllm_launch
    tok = smollm2.tokenizer
    lead = prompt_ids(tok, [HEADER])
    key = EntryAddress.of(launch.skills.manifest).key(lead, [], f"{OWNER}-g")
    path = launch.skills.folder / f"{key}{ENTRY_SUFFIX}"
    VllmPrefill(launch.server.url, launch.server.served_name).prefill(
        lead, SaveRequest(key, 0, len(lead) + 5, "past", f"{OWNER}-g"))
    assert not path.exists()


def test_the_learner_never_waits_on_a_compile(vllm_launch, smollm2):
    """observe() returns at once while the worker's compile request runs on the server."""
    launch = vllm_launch
    tok = smollm2.tokenizer
    started, release = threading.Event(), threading.Event()

    class Slow:
        def prefill(self, prompt, save):
            started.set()
            release.wait(30)

    compiler = vllm_compiler(launch, Slow())
    learner = Learner(LearnConfig(after=1, min_tokens=4), launch.skills,
                      compiler=compiler).start()
    try:
        text = skill_copy("cancellation", OWNER)
        chunk = SeenChunk("content", text, tuple(encode(tok, text)),
                          tuple(prompt_ids(tok, [HEADER])))
        learner.observe(f"{OWNER}-h", [chunk])
        assert started.wait(10)
        t0 = time.perf_counter()
        learner.observe(f"{OWNER}-i", [chunk])
        assert time.perf_counter() - t0 < 0.05
    finally:
        release.set()
        learner.stop()
    assert learner.counters()["failures"] >= 1  # the slow client saved nothing
