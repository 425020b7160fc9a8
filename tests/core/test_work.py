"""The FLOP model of kvnotes.core.work against a brute-force count and torch's own FLOP counter,
and the engine's work counter."""

from __future__ import annotations

import itertools

import pytest
from conftest import make_tiny_engine
from torch.utils.flop_counter import FlopCounterMode

from kvnotes.core.work import CostModel, Work, WorkCounter, keys_attended


@pytest.mark.parametrize("n_new,past,window", list(itertools.product(
    [1, 2, 5, 13], [0, 1, 4, 9, 30], [None, 1, 3, 8, 40])))
def test_keys_attended_matches_brute_force(n_new, past, window):
    brute = sum(min(past + i + 1, window) if window else past + i + 1 for i in range(n_new))
    assert keys_attended(n_new, past, window) == brute


def test_matmul_flops_match_torch_counter(tiny_llama):
    """The weights' share of the model agrees exactly with torch's FLOP counter (which does not
    see the CPU attention kernel), so only attention is left to the formula."""
    engine = tiny_llama
    nb = engine.prefill(list(range(5, 25)), bos=False)
    cost = engine.cost
    for n in (1, 7):
        mark = engine.work.snapshot()
        with FlopCounterMode(display=False) as counter:
            engine.forward(nb, list(range(30, 30 + n)))
        done = engine.work.since(mark)
        assert (done.calls, done.tokens) == (1, n)
        attention = 4 * cost.attention_width * sum(keys_attended(n, len(nb), w)
                                                   for w in cost.windows)
        assert done.flops - attention == counter.get_total_flops()


def test_attention_flops_match_torch_counter_in_eager_attention(tokenizer):
    """With eager attention (plain matmuls, counted by torch) one new token's whole forward,
    attention included, is what the model says."""
    engine = make_tiny_engine("llama", tokenizer, attn_implementation="eager")
    nb = engine.prefill(list(range(5, 40)), bos=False)
    mark = engine.work.snapshot()
    with FlopCounterMode(display=False) as counter:
        engine.forward(nb, [50])
    assert engine.work.since(mark).flops == counter.get_total_flops()


def test_cost_model_reads_sliding_windows(tokenizer):
    engine = make_tiny_engine("gemma3_text", tokenizer)  # layer 0 slides over 8 tokens
    assert engine.cost.windows == (8, None)
    full = make_tiny_engine("llama", tokenizer).cost
    assert engine.cost.flops(4, 100) < CostModel(full.body_weights, full.head_weights,
                                                 engine.cost.attention_width,
                                                 (None, None)).flops(4, 100)


def test_attention_share_is_what_the_past_adds(tiny_llama):
    cost = tiny_llama.cost
    assert cost.attention_share(10, 0) == 0.0
    share = cost.attention_share(10, 1000)
    assert 0 < share < 1
    assert (1 - share) * cost.flops(10, 1000) == pytest.approx(cost.flops(10, 0))
    assert cost.attention_share(10, 4000) > share


def test_prefill_and_batch_are_counted(tiny_llama):
    """Work goes through the one counted call: a prefill costs its tokens from position 0, and a
    batch of rows costs each row (one kept logit row each)."""
    engine = tiny_llama
    mark = engine.work.snapshot()
    nb = engine.prefill(list(range(5, 15)), bos=False)
    assert engine.work.since(mark) == Work(1, 10, engine.cost.flops(10, 0))
    mark = engine.work.snapshot()
    engine.forward_batch([nb, nb, nb], [20, 21])
    assert engine.work.since(mark) == Work(1, 6, engine.cost.flops(2, 10, rows=3))


def test_work_since_a_snapshot_is_the_difference():
    counter = WorkCounter()
    counter.add(3, 1.5)
    mark = counter.snapshot()
    counter.add(4, 2.0)
    counter.add(1, 0.5)
    assert mark == Work(1, 3, 1.5)  # a frozen copy: later work does not change it
    assert counter.since(mark) == Work(calls=2, tokens=5, flops=2.5)
    assert counter.snapshot() - mark == counter.since(mark)
