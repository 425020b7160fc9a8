"""Notebook storage: in-place append, copy-on-write, splices into the destination, bounded memory,
kept logits (tiny random models)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_engine
from torch.profiler import ProfilerActivity, profile

from kvnotes.core.positions.rope import rotate_keys

TEXT = "Order status: pending. Refunds apply to orders placed before the end of the month."


def _ptrs(nb) -> list[int]:
    return [nb.storage.keys[l].data_ptr() for l in range(nb.num_layers)]


def _snapshot(nb) -> list[torch.Tensor]:
    return [t.clone() for l in range(nb.num_layers) for t in (nb.keys(l), nb.values(l))]


def test_in_place_append_does_not_copy(tiny_llama):
    nb = tiny_llama.prefill(TEXT)
    nb = tiny_llama.extend(nb, " More.")  # the first append after prefill grows the buffers
    ptrs, capacity = _ptrs(nb), nb.storage.capacity
    longer = tiny_llama.extend(nb, " And")
    assert longer.storage is nb.storage and _ptrs(longer) == ptrs
    assert longer.storage.capacity == capacity and nb.storage_range[1] == len(nb)
    # the earlier tokens of the longer notebook are the very same memory
    assert longer.keys(0).data_ptr() == nb.keys(0).data_ptr()
    assert torch.equal(longer.keys(0)[..., :len(nb), :], nb.keys(0))


def test_buffers_grow_by_doubling(tiny_llama):
    nb = tiny_llama.prefill(TEXT)
    moves = 0
    for _ in range(40):
        before = _ptrs(nb)
        nb = tiny_llama.extend(nb, [42])
        moves += _ptrs(nb) != before
    assert moves <= 3  # 40 appends after len(TEXT) tokens: log2 growth, not one copy per token


def test_extending_an_old_notebook_never_changes_a_newer_one(tiny_llama):
    base = tiny_llama.prefill(TEXT)
    newer = tiny_llama.extend(base, " The order shipped.")
    kept = _snapshot(newer)
    kept_ids = newer.token_ids.clone()
    other = tiny_llama.extend(base, " The order was lost in transit.")  # copy-on-write
    assert other.storage is not newer.storage
    assert all(torch.equal(a, b) for a, b in zip(kept, _snapshot(newer), strict=True))
    assert torch.equal(newer.token_ids, kept_ids)
    # the branch sees base's notes, then its own
    assert torch.equal(other.keys(0)[..., :len(base), :], base.keys(0))
    # a slice is a view, and extending it copies too
    head = newer.slice(0, 5)
    assert head.storage is newer.storage
    tiny_llama.extend(head, " x")
    assert all(torch.equal(a, b) for a, b in zip(kept, _snapshot(newer), strict=True))


def test_greedy_and_next_logits_keep_the_old_notebook(tiny_llama):
    nb = tiny_llama.prefill(TEXT)
    kept = _snapshot(nb)
    a = tiny_llama.greedy(nb, " Next:", max_new_tokens=6)
    b = tiny_llama.greedy(nb, " Next:", max_new_tokens=6)
    assert a.token_ids == b.token_ids
    assert all(torch.equal(x, y) for x, y in zip(kept, _snapshot(nb), strict=True))
    # a query read gives its storage back: nb is still appended to in place afterwards
    tiny_llama.next_logits(nb, " Question?")
    fresh = tiny_llama.prefill(TEXT)
    tiny_llama.next_logits(fresh, " Question?")
    assert tiny_llama.extend(fresh, " ok").storage is fresh.storage


def test_next_logits_reads_the_kept_logits_without_a_forward(tiny_llama):
    nb = tiny_llama.prefill(TEXT)
    assert nb.last_logits is not None
    refed = tiny_llama.next_logits(nb.slice(0, len(nb)))  # a slice of all keeps them too
    plain = tiny_llama.probe(nb.slice(0, len(nb) - 1), [int(nb.token_ids[-1])])[-1]
    assert torch.allclose(refed, plain, atol=1e-5)
    calls = []
    handle = tiny_llama.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        tiny_llama.next_logits(nb)
        tiny_llama.greedy(nb, None, max_new_tokens=1)
    finally:
        handle.remove()
    assert not calls


def test_greedy_decodes_without_copying_the_context(tiny_llama):
    nb = tiny_llama.prefill(TEXT * 4)
    nb = tiny_llama.extend(nb, " Next:")
    ptrs = _ptrs(nb)  # capacity doubled by the append above: room for the decode below
    gen = tiny_llama.greedy(nb, None, max_new_tokens=8)
    assert gen.notebook.storage is nb.storage and _ptrs(gen.notebook) == ptrs


def test_splice_writes_the_rotated_skill_into_the_destination(tiny_llama):
    skill = tiny_llama.compile(TEXT, name="policy")
    head = tiny_llama.prefill("Customer: hello. ")
    spliced = head.splice(skill)
    expected = skill.moved_to(head.next_position)
    assert spliced.storage is head.storage
    assert spliced.positions.tolist() == list(range(len(spliced)))
    assert spliced.span("policy").start == len(head)
    for l in range(head.num_layers):
        assert torch.allclose(spliced.keys(l)[..., len(head):, :], expected.keys(l), atol=1e-6)
        assert torch.equal(spliced.values(l)[..., len(head):, :], skill.values(l))


@pytest.mark.parametrize("dims", [64, 48])  # full and partial rotary
def test_rotate_keys_into_out_equals_the_plain_rotation(dims):
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 17, 64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims))
    out = torch.empty_like(keys)
    rotate_keys(keys, inv_freq, 37, out=out)
    assert torch.allclose(out, rotate_keys(keys, inv_freq, 37), atol=1e-6)


def _peak_cpu_bytes(fn) -> tuple[int, object]:
    """Peak bytes allocated by torch ops on CPU while ``fn`` runs (the profiler's memory
    events; an allocation counts from its op's start, so this errs high)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = []
    for e in prof.events():
        change = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if change:
            events.append((e.time_range.start, change))
    live = peak = 0
    for _, change in sorted(events):
        live += change
        peak = max(peak, live)
    return peak, result


def test_composing_4k_tokens_costs_the_notebook_plus_a_constant(tokenizer):
    # enough KV per token (4 layers x 4 heads x 64 dims) that the notebook dwarfs the constant
    engine = make_tiny_engine("llama", tokenizer, hidden_size=256, num_attention_heads=4,
                              num_key_value_heads=4, num_hidden_layers=4)
    sentence = "Refunds are issued within five days of the return being received. "
    skills = [engine.compile(sentence * 90, name=f"s{i}") for i in range(3)]
    parts = ["Customer record: order 12. ", skills[0], skills[1], " Policy follows. ", skills[2],
             " Question: refund? Answer:"]
    engine.compose(parts)  # warm-up: lazily built model state is not the compose's memory
    peak, nb = _peak_cpu_bytes(lambda: engine.compose(parts))
    assert len(nb) > 3500
    constant = 8 * 2**20
    assert peak <= nb.nbytes + constant, (peak, nb.nbytes)


def test_probe_rows_are_the_logits_after_each_prefix(tiny_llama):
    nb = tiny_llama.prefill(TEXT)
    ids = tiny_llama.encode(" refund approved")
    rows = tiny_llama.probe(nb, ids)
    assert rows.shape[0] == len(ids)
    assert nb.storage.fill == nb.storage_range[1]  # nothing kept
    for k in range(1, len(ids) + 1):
        assert torch.allclose(rows[k - 1], tiny_llama.extend(nb, ids[:k]).last_logits, atol=1e-5)


@pytest.mark.parametrize("arch", ["gemma3_text", "mistral"])  # sliding window 8 in tiny configs
def test_feeding_in_pieces_past_the_window_equals_one_prefill(tokenizer, arch):
    engine = make_tiny_engine(arch, tokenizer)
    ids = engine.encode(TEXT * 3)[:40]
    whole = engine.prefill(ids)
    nb = engine.prefill(ids[:10])
    for i in range(10, 40, 10):
        nb = engine.extend(nb, ids[i:i + 10])
    assert len(nb) == 40 > engine.adapter.sliding_window
    for l in range(nb.num_layers):
        assert torch.allclose(nb.keys(l), whole.keys(l), atol=1e-5)
        assert torch.allclose(nb.values(l), whole.values(l), atol=1e-5)
    assert torch.allclose(nb.last_logits, whole.last_logits, atol=1e-4)
