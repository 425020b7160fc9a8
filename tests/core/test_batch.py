"""Batched forwards and decoding over notebooks of different lengths (left-padded, masked):
each row equals the same work done on that notebook alone."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_engine

import kvnotes
from kvnotes.core.batch import _batch_positions
from kvnotes.core.cache import build_padded_cache
from kvnotes.core.errors import EmptyInputError, InvalidArgumentError, KvnotesError
from kvnotes.ops.decisions import decide, decide_batch

RECORD = "Order #4411: status pending; item desk lamp; payment card. "
QUERY = " Should the refund be approved? Answer yes or no."


def _notebooks(engine: kvnotes.Engine) -> list[kvnotes.Notebook]:
    """Three notebooks of different lengths and positions: padding really happens, and a
    sliding window of 8 (gemma3, mistral below) sees pads inside its reach."""
    base = engine.prefill(RECORD * 2)
    return [base, engine.prefill(RECORD), engine.extend(base, " Correction: it is delivered.")]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "mistral", "qwen3"])
def test_forward_batch_rows_equal_each_notebook_alone(arch, tokenizer):
    engine = make_tiny_engine(arch, tokenizer)
    notebooks = _notebooks(engine)
    assert len({len(nb) for nb in notebooks}) == 3
    ids = engine.encode(QUERY)
    batched = engine.forward_batch(notebooks, ids)  # [3, vocab]
    alone = torch.stack([engine.next_logits(nb, ids) for nb in notebooks])
    assert torch.allclose(batched, alone, atol=1e-5, rtol=0)


def test_padding_mask_is_what_makes_rows_exact(tiny_llama):
    """The control for the test above: the same padded batch without the mask reads the pads'
    zero keys and gives other logits for the padded rows, so that test can fail."""
    notebooks = _notebooks(tiny_llama)
    ids = tiny_llama.encode(QUERY)
    cache, pads = build_padded_cache(notebooks)
    assert pads[2] == 0 < pads[1]  # the extended notebook is the longest
    starts = [nb.next_position for nb in notebooks]
    unmasked = tiny_llama.call_model(cache, [ids] * 3, _batch_positions(tiny_llama, starts,
                                                                         len(ids)))
    logits = unmasked.logits[:, -1].float()
    assert torch.allclose(logits[2], tiny_llama.next_logits(notebooks[2], ids), atol=1e-5)
    assert not torch.allclose(logits[1], tiny_llama.next_logits(notebooks[1], ids), atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_greedy_batch_equals_greedy_per_row(arch, tokenizer):
    engine = make_tiny_engine(arch, tokenizer)
    notebooks = _notebooks(engine)
    rows = engine.greedy_batch(notebooks, QUERY, 12)
    for nb, row in zip(notebooks, rows, strict=True):
        alone = engine.greedy(nb, QUERY, 12)
        assert row.token_ids == alone.token_ids and row.text == alone.text
        assert torch.allclose(row.first_logits, alone.first_logits, atol=1e-5, rtol=0)


def test_batched_rows_stop_on_their_own(tiny_llama):
    """A row that meets a stop string stops there while the others go on, as each would alone."""
    notebooks = _notebooks(tiny_llama)
    free = [tiny_llama.greedy(nb, QUERY, 10) for nb in notebooks]
    stop = free[1].text[:3]  # the second row stops within a few tokens
    assert stop and all(stop not in g.text for i, g in enumerate(free) if i != 1)
    rows = tiny_llama.greedy_batch(notebooks, QUERY, 10, stop=[stop])
    for nb, row in zip(notebooks, rows, strict=True):
        assert row.token_ids == tiny_llama.greedy(nb, QUERY, 10, stop=[stop]).token_ids
    assert len(rows[1].token_ids) < 10 == len(rows[0].token_ids)


def test_batch_leaves_notebooks_unchanged_and_extendable(tiny_llama):
    notebooks = _notebooks(tiny_llama)
    before = [(len(nb), nb.keys(1).clone()) for nb in notebooks]
    tiny_llama.greedy_batch(notebooks, QUERY, 4)
    tiny_llama.forward_batch(notebooks, tiny_llama.encode(QUERY))
    for nb, (n, keys) in zip(notebooks, before, strict=True):
        assert len(nb) == n and torch.equal(nb.keys(1), keys)
    assert len(tiny_llama.extend(notebooks[0], QUERY)) > len(notebooks[0])


def test_decide_batch_with_cot_equals_decide(tiny_llama):
    notebooks = _notebooks(tiny_llama)
    batched = decide_batch(tiny_llama, notebooks, QUERY, ["yes", "no"], cot=True, budget=8)
    for nb, d in zip(notebooks, batched, strict=True):
        alone = decide(tiny_llama, nb, QUERY, ["yes", "no"], cot=True, budget=8)
        assert d.text == alone.text and d.answer == alone.answer
        assert d.scores == pytest.approx(alone.scores, abs=1e-5)
        assert 0 < d.first_seconds <= d.seconds
    plain = decide_batch(tiny_llama, notebooks, QUERY, ["yes", "no"])
    assert [d.answer for d in plain] == [decide(tiny_llama, nb, QUERY, ["yes", "no"]).answer
                                         for nb in notebooks]


def test_batch_bad_input_is_refused_clearly(tiny_llama, tokenizer):
    nb = tiny_llama.prefill(RECORD)
    with pytest.raises(EmptyInputError, match="at least one notebook"):
        tiny_llama.forward_batch([], [1])
    with pytest.raises(EmptyInputError, match="at least one token"):
        tiny_llama.forward_batch([nb], [])
    with pytest.raises(EmptyInputError, match="at least one notebook"):
        tiny_llama.greedy_batch([], QUERY)
    with pytest.raises(InvalidArgumentError, match=r"one row of logits per notebook \(\[2, vocab"):
        tiny_llama.continue_greedy_batch([nb, nb], tiny_llama.next_logits(nb)[None], 3)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        tiny_llama.greedy_batch([nb], QUERY, 0)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        tiny_llama.continue_greedy_batch([nb], tiny_llama.next_logits(nb)[None], 0)
    other = make_tiny_engine("llama", tokenizer, seed=1)
    with pytest.raises(KvnotesError, match="different model"):
        tiny_llama.forward_batch([nb, other.prefill(RECORD)], [1])
    with pytest.raises(kvnotes.PositionError):
        tiny_llama.forward_batch([nb, nb.shifted(4096 - len(nb))], tiny_llama.encode(QUERY))
