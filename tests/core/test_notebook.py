"""Notebook core: shifting exactness, slicing, concat, save/load, clear errors."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_engine
from hypothesis import given, settings
from hypothesis import strategies as st

import kvnotes
from kvnotes import Document, Field, Notebook

TEXT = "Order status: pending. Refunds apply to orders placed before the end of the month."

SHIFT_CASES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "gemma3_text": {},
    "llama-linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
    "llama-llama3": {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
    "llama-yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                       "original_max_position_embeddings": 1024}},
}


@pytest.fixture(scope="module", params=list(SHIFT_CASES))
def shift_engine(request, tokenizer):
    arch = request.param.split("-")[0]
    return make_tiny_engine(arch, tokenizer, **SHIFT_CASES[request.param])


def max_key_error(a: Notebook, b: Notebook) -> float:
    return max(float((a.keys(l) - b.keys(l)).abs().max()) for l in range(a.num_layers))


@pytest.mark.parametrize("offset", [1, 37, 500, 2000])
def test_shifted_equals_prefill_at_offset(shift_engine, offset):
    moved = shift_engine.prefill(TEXT, 0).shifted(offset)
    direct = shift_engine.prefill(TEXT, offset)
    assert torch.equal(moved.positions, direct.positions)
    assert max_key_error(moved, direct) <= 1e-4
    # values carry no position: within float error of the directly prefilled ones
    assert max(float((moved.values(l) - direct.values(l)).abs().max())
               for l in range(moved.num_layers)) <= 1e-4


def test_shift_then_back_is_identity(tiny_llama):
    nb = tiny_llama.prefill(TEXT, 0)
    back = nb.shifted(321).shifted(-321)
    assert max_key_error(nb, back) <= 1e-5


@settings(max_examples=15, deadline=None)
@given(start=st.integers(0, 300), delta=st.integers(-300, 600))
def test_shift_property_random_offsets(tiny_llama, start, delta):
    if start + delta < 0:
        with pytest.raises(kvnotes.PositionError, match="negative position"):
            tiny_llama.prefill("a short note", start).shifted(delta)
        return
    moved = tiny_llama.prefill("a short note", start).shifted(delta)
    direct = tiny_llama.prefill("a short note", start + delta)
    assert max_key_error(moved, direct) <= 1e-4


def test_gemma3_sliding_window_keeps_every_token(tokenizer):
    engine = make_tiny_engine("gemma3_text", tokenizer)  # sliding_window=8 on layer 0
    nb = engine.prefill(TEXT)
    assert len(nb) > 8
    assert all(nb.keys(l).shape[-2] == len(nb) for l in range(nb.num_layers))
    # feeding the notebook back gives the model's own logits (its sliding mask still applies)
    ids = nb.token_ids
    with torch.no_grad():
        own = engine.model(ids[None]).logits[0, -1]
    mine = engine.next_logits(engine.prefill(ids[:-1]), ids[-1:])
    assert torch.allclose(own, mine, atol=1e-4)


def test_dynamic_rope_is_refused_unless_approximate_allowed(tokenizer):
    engine = make_tiny_engine("llama", tokenizer, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    assert engine.adapter.approximate and not engine.adapter.exact_shift
    nb = engine.prefill(TEXT)
    with pytest.raises(kvnotes.PositionError, match="allow_approximate=True"):
        nb.shifted(10)
    assert nb.shifted(10, allow_approximate=True).positions[0] == 10


def test_slice_and_concat_round_trip(tiny_llama):
    nb = tiny_llama.prefill(Document(["Status: ", Field("status", "pending"), ". Thanks."]))
    head, tail = nb.slice(0, 3), nb.slice(3)
    joined = Notebook.concat([head, tail])
    assert torch.equal(joined.token_ids, nb.token_ids)
    assert torch.equal(joined.positions, nb.positions)
    assert all(torch.equal(joined.keys(l), nb.keys(l)) for l in range(nb.num_layers))
    assert joined.span("status") == nb.span("status")


def test_operations_never_mutate(tiny_llama):
    nb = tiny_llama.prefill(TEXT)
    keys = [nb.keys(l).clone() for l in range(nb.num_layers)]
    nb.shifted(50)
    tiny_llama.extend(nb, " More text.")
    tiny_llama.next_logits(nb, " Query")
    assert all(torch.equal(k, nb.keys(l)) for l, k in enumerate(keys))
    assert nb.positions[0] == 0


def test_save_load_round_trip_bit_identical(tiny_llama, tmp_path):
    nb = tiny_llama.prefill(Document(["Status: ", Field("status", "pending"), "."]), start=7)
    path = nb.save(tmp_path / "nb.safetensors")
    back = Notebook.load(path, tiny_llama)
    assert torch.equal(back.token_ids, nb.token_ids) and torch.equal(back.positions, nb.positions)
    assert back.spans == nb.spans
    for l in range(nb.num_layers):
        assert torch.equal(back.keys(l), nb.keys(l)) and torch.equal(back.values(l), nb.values(l))


def test_load_refuses_a_notebook_of_another_model(tiny_llama, tokenizer, tmp_path):
    other = make_tiny_engine("llama", tokenizer, seed=1)  # same config, other weights
    path = tiny_llama.prefill(TEXT).save(tmp_path / "nb.safetensors")
    with pytest.raises(kvnotes.NotebookMismatchError, match="different model.*weights_sha"):
        Notebook.load(path, other)
    qwen = make_tiny_engine("qwen2", tokenizer)
    with pytest.raises(kvnotes.NotebookMismatchError, match="LlamaForCausalLM"):
        Notebook.load(path, qwen)


def test_load_refuses_truncated_and_tampered_files(tiny_llama, tmp_path):
    path = tiny_llama.prefill(TEXT).save(tmp_path / "nb.safetensors")
    data = path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(kvnotes.NotebookFileError, match="truncated or corrupted"):
        Notebook.load(truncated, tiny_llama)
    tampered = tmp_path / "tampered.safetensors"
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF  # inside the last tensor's bytes
    tampered.write_bytes(bytes(flipped))
    with pytest.raises(kvnotes.NotebookFileError, match="checksum"):
        Notebook.load(tampered, tiny_llama)
    with pytest.raises(kvnotes.NotebookFileError, match="no notebook file"):
        Notebook.load(tmp_path / "missing.safetensors", tiny_llama)


def test_splicing_a_foreign_notebook_is_refused(tiny_llama, tokenizer):
    other = make_tiny_engine("qwen2", tokenizer)
    skill = other.compile("a skill")
    with pytest.raises(kvnotes.NotebookMismatchError, match="splice a skill"):
        tiny_llama.compose(["context ", skill])


def _copier(source: Notebook, start: int, calls: list):
    """A writer that copies ``source``'s notes from ``start`` on into the claimed rows."""
    def write(claim):
        calls.append((claim.start, claim.end, claim.count))
        for l in range(source.num_layers):
            keys = source.keys(l)[..., start:start + claim.count, :]
            values = source.values(l)[..., start:start + claim.count, :]
            k_out, v_out = claim.slots(l, keys, values)
            k_out.copy_(keys)
            v_out.copy_(values)
        return "written"
    return write


def test_append_records_ids_positions_spans_and_gives_back_on_failure(tiny_llama):
    full = tiny_llama.prefill(TEXT)
    # a copy of the first 6 tokens in storage of its own, with room for the rest
    head = Notebook.concat([tiny_llama.empty(0, capacity=len(full)), full.slice(0, 6)])
    calls: list = []
    tail_ids, tail_pos = full.token_ids[6:], full.positions[6:]
    longer, result = head.append(tail_ids, tail_pos, _copier(full, 6, calls),
                                 spans=[kvnotes.Span("rest", "text", 0, len(full) - 6)])
    assert result == "written" and calls == [(0, 6, len(full) - 6)]
    assert longer.storage is head.storage  # in place: head ends at its storage's fill point
    assert torch.equal(longer.token_ids, full.token_ids)
    assert torch.equal(longer.positions, full.positions)
    assert longer.span("rest") == kvnotes.Span("rest", "text", 6, len(full))
    assert torch.equal(longer.keys(1), full.keys(1)) and longer.last_logits is None
    assert len(head) == 6  # the input is never changed
    # a probe's rows are given back; so are a failed write's: the next append is in place again
    n = len(full)
    more_ids, more_pos = full.token_ids[:2], torch.tensor([n, n + 1])
    same, _ = longer.append(more_ids, more_pos, _copier(full, 0, []), keep=False)
    assert same is longer and longer.storage.fill == n

    def fail(claim):
        raise RuntimeError("model failed")

    with pytest.raises(RuntimeError, match="model failed"):
        longer.append(more_ids, more_pos, fail)
    assert longer.storage.fill == n
    again, _ = longer.append(more_ids, more_pos, _copier(full, 0, []))
    assert again.storage is longer.storage and longer.storage.fill == n + 2
    assert again.positions[-2:].tolist() == [n, n + 1]


def test_rewritten_copies_unless_in_place(tiny_llama):
    nb = tiny_llama.prefill(TEXT)
    other = tiny_llama.prefill("Completely different words sit here, and there are many of them.")
    before = nb.keys(0).clone()
    assert not torch.equal(other.keys(0)[..., 2:7, :], before[..., 2:7, :])
    calls: list = []
    copy, _ = nb.rewritten(2, 5, _copier(other, 2, calls))
    assert calls == [(0, 2, 3)] and copy.storage is not nb.storage
    assert torch.equal(nb.keys(0), before)  # untouched
    assert torch.equal(copy.keys(0)[..., 2:5, :], other.keys(0)[..., 2:5, :])
    assert torch.equal(copy.token_ids, nb.token_ids) and copy.last_logits is None
    same, _ = copy.rewritten(5, 7, _copier(other, 5, []), in_place=True)
    assert same.storage is copy.storage
    assert torch.equal(copy.keys(0)[..., 5:7, :], other.keys(0)[..., 5:7, :])
    with pytest.raises(kvnotes.KvnotesError, match=r"rewrite \[3, 99\) is out of range"):
        nb.rewritten(3, 99, _copier(other, 3, []))


def test_load_takes_anything_with_a_fingerprint_adapter_and_device(tiny_llama, tmp_path):
    # Notebook.load types its engine with a Protocol: the core never imports the engine
    class Owner:
        fingerprint, adapter, device = tiny_llama.fingerprint, tiny_llama.adapter, "cpu"

    nb = tiny_llama.prefill(TEXT)
    back = Notebook.load(nb.save(tmp_path / "n.safetensors"), Owner())
    assert torch.equal(back.keys(0), nb.keys(0))
