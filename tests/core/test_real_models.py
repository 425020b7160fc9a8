"""The bundled real models: composition against full recompute on short realistic cases."""

from __future__ import annotations

import pytest
import torch

import kvnotes
from kvnotes.core.chat import chat_frame
from kvnotes.core.repair import DEFAULT_FIRST

pytestmark = pytest.mark.real

SKILL = ("RETURNS: Unworn items may be returned within 30 days of delivery for a full refund. "
         "Items returned between day 31 and day 60 get store credit only. Final-sale items, gift "
         "cards and opened hygiene products cannot be returned. Return shipping is free for "
         "loyalty members; everyone else pays 6.95.")
CONTEXTS = [
    ("Customer: a loyalty member. Order delivered 12 days ago, boots unworn in the box.",
     "Can the customer get a full refund?"),
    ("Customer: not a member. Order delivered 45 days ago, a jacket with tags.",
     "What does the customer receive for the return?"),
]


def parts_for(engine, skill, context):
    head, middle, tail = chat_frame(engine.tokenizer)
    return [head + "You are a support agent. Policy:\n", skill, middle + context], tail


@pytest.mark.parametrize("case", range(len(CONTEXTS)))
def test_composed_matches_recompute(real_engine, case):
    skill = real_engine.compile(SKILL, name="returns")
    context, question = CONTEXTS[case]
    parts, tail = parts_for(real_engine, skill, context)
    report = kvnotes.fidelity(real_engine, parts, "\n" + question + tail, max_new_tokens=8)
    # compiled alone and placed after the header: its first tokens are recomputed in context
    assert report.tokens_repaired == DEFAULT_FIRST
    assert report.tokens_reused == len(skill) - DEFAULT_FIRST
    assert report.logit_cosine >= 0.99, report
    assert report.top1_agree, report


def test_shift_exact_on_real_model(real_engine):
    nb = real_engine.prefill(SKILL)
    moved, direct = nb.shifted(300), real_engine.prefill(SKILL, start=300)
    err = max(float((moved.keys(l) - direct.keys(l)).abs().max()) for l in range(nb.num_layers))
    assert err <= 1e-3  # real-model keys are O(10): 1e-3 absolute is ~1e-4 relative


def test_gemma_keeps_full_sequence_in_sliding_layers(gemma3):
    assert gemma3.adapter.sliding_window == 512 and gemma3.adds_bos
    nb = gemma3.prefill("word " * 520)  # past the 512-token window
    assert all(nb.keys(l).shape[-2] == len(nb) for l in range(nb.num_layers))
    ids = nb.token_ids
    with torch.no_grad():
        own = gemma3.model(ids[None]).logits[0, -1]
    mine = gemma3.next_logits(nb)
    assert torch.allclose(own, mine, atol=1e-3)


def test_real_notebook_round_trip_and_foreign_model_error(smollm2, gemma3, tmp_path):
    nb = smollm2.prefill("Order status: pending.")
    path = nb.save(tmp_path / "nb.safetensors")
    back = kvnotes.Notebook.load(path, smollm2)
    assert torch.equal(back.keys(3), nb.keys(3))
    with pytest.raises(kvnotes.NotebookMismatchError, match="LlamaForCausalLM.*Gemma3ForCausalLM"):
        kvnotes.Notebook.load(path, gemma3)


def test_anchored_skill_and_full_repair_match_recompute(real_engine):
    """compile(after=header) right after that header is exact; repair=1.0 over a skill that
    follows other text equals a full prefill (short texts: one check per model)."""
    head, middle, tail = chat_frame(real_engine.tokenizer)
    header = head + "You are a support agent. Policy:\n"
    skill = real_engine.compile(SKILL, name="returns", after=header)
    query = middle + CONTEXTS[0][0] + "\n" + CONTEXTS[0][1] + tail
    exact = kvnotes.fidelity(real_engine, [real_engine.compile(header), skill], query,
                             max_new_tokens=1)
    assert exact.kl < 1e-4 and exact.top1_agree, exact
    assert exact.tokens_repaired == 0  # exactly placed: spliced as it is
    repaired = kvnotes.fidelity(real_engine, [header, "Read carefully.\n", skill], query,
                                max_new_tokens=1, repair=1.0)
    assert repaired.tokens_repaired == len(skill) and repaired.kl < 1e-4, repaired


SHIPPING = ("SHIPPING: Orders ship within two business days. Standard delivery takes three to five "
            "days and is free above 50.00; express delivery takes one day and costs 9.90, "
            "refunded when the parcel arrives late. Lost parcels are replaced once after a "
            "carrier claim.")


def test_default_repair_is_closer_to_the_exact_prompt_than_the_bare_splice(smollm2):
    """A header and two policies compiled behind it: the first sits where it was compiled
    (kept), the second's first tokens are recomputed in context by default."""
    head, middle, tail = chat_frame(smollm2.tokenizer)
    header = head + "You are a support agent. Policies:\n"
    skills = [smollm2.compile(t, after=header) for t in (SHIPPING, SKILL)]
    context, question = CONTEXTS[0]
    parts = [smollm2.compile(header), *skills, middle + context]
    query = "\n" + question + tail
    repaired = kvnotes.fidelity(smollm2, parts, query, max_new_tokens=1)
    bare = kvnotes.fidelity(smollm2, parts, query, max_new_tokens=1, repair=0)
    assert repaired.tokens_repaired == DEFAULT_FIRST and bare.tokens_repaired == 0
    assert repaired.top1_agree and repaired.kl < bare.kl, (repaired, bare)
