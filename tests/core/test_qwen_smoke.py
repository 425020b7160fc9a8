"""Qwen2.5-Coder Instruct at deployment size: a smoke test per operation (0.5B in `make test`,
1.5B in `make test-large`).

The model runs in bfloat16 where the CPU has it natively (as users are told to run it), so
comparisons with recompute allow bfloat16's rounding (8 bits of mantissa): layer 0's
re-rotated keys differ from keys prefilled at the new position by 0.1% of their norm, deeper
layers' by 1-3% (rounding of everything computed at other positions), and the logit cosine of a
composed prompt stays above 0.99.
"""

from __future__ import annotations

import pytest

import kvnotes
from kvnotes.core.chat import chat_frame
from kvnotes.core.repair import DEFAULT_FIRST

pytestmark = pytest.mark.real


@pytest.fixture(scope="module", params=["qwen05", pytest.param("qwen15", marks=pytest.mark.large)])
def qwen(request):
    """The 0.5B (``make test``) and the 1.5B (``make test-large`` only)."""
    return request.getfixturevalue(request.param)

SKILL = ("RETURNS: Unworn items may be returned within 30 days of delivery for a full refund. "
         "Items returned between day 31 and day 60 get store credit only. Final-sale items, gift "
         "cards and opened hygiene products cannot be returned. Return shipping is free for "
         "loyalty members; everyone else pays 6.95.")
TOOLS = [
    {"type": "function", "function": {
        "name": "book_flight", "description": "Book a flight",
        "parameters": {"type": "object", "required": ["origin", "destination", "date"],
                       "properties": {"origin": {"type": "string"},
                                      "destination": {"type": "string"},
                                      "date": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string"}}}}},
]


def test_the_aliases_load_as_qwen2(qwen):
    assert qwen.model.config.model_type == "qwen2"
    assert qwen.adapter.name == "rope" and qwen.model.config.num_key_value_heads == 2
    assert qwen.adapter.num_layers == {"qwen2.5-coder-0.5b": 24, "qwen2.5-coder-1.5b": 28}[qwen.name]


def test_composed_matches_recompute(qwen):
    head, middle, tail = chat_frame(qwen.tokenizer)
    skill = qwen.compile(SKILL, name="returns")
    parts = [head + "You are a support agent. Policy:\n", skill,
             middle + "Customer: a loyalty member. Order delivered 12 days ago, boots unworn."]
    report = kvnotes.fidelity(qwen, parts, "\nCan the customer get a full refund?" + tail,
                              max_new_tokens=6)
    assert report.tokens_repaired == DEFAULT_FIRST
    assert report.tokens_reused == len(skill) - DEFAULT_FIRST
    assert report.logit_cosine >= 0.99, report
    assert report.top1_agree and report.continuation_identical, report


def test_shift_within_bfloat16_rounding(qwen):
    nb = qwen.prefill(SKILL)
    moved, direct = nb.shifted(300), qwen.prefill(SKILL, start=300)
    def rel(layer: int) -> float:
        a, b = moved.keys(layer).float(), direct.keys(layer).float()
        return float((a - b).norm() / b.norm())

    # layer 0's keys are one projection away from the embeddings: the re-rotation alone
    assert rel(0) <= 0.005
    # deeper keys also carry bfloat16 rounding of attention at other positions (0 in float32)
    assert max(rel(layer) for layer in range(nb.num_layers)) <= 0.05


def test_answers_a_tools_request_with_the_right_call(qwen):
    text = qwen.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Book me a flight from Paris to Rome on 2026-12-20."}],
        tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "book_flight" in text and "<tools>" in text  # the template renders the tools
    answer = qwen.generate(qwen.prefill(text), "", max_new_tokens=14)
    assert '"name": "book_flight"' in answer, answer
