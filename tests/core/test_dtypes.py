"""Engines in other dtypes: notes in the model's dtype, files tied to it, fingerprints of the
model rather than of where it lives.

Decision (documented in docs/bench/repro.md and the guide): a notebook saved from an engine of one
dtype is refused by an engine of another, with an error naming the dtype. Casting silently would
hand back notes the other engine never wrote (bfloat16 notes are not float32 notes rounded): the
fix is to prefill again in the new dtype.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_tiny_model

import kvnotes
from kvnotes.core.errors import NotebookMismatchError
from kvnotes.core.fingerprint import ModelFingerprint


@pytest.fixture(scope="module")
def engines(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    return (kvnotes.Engine.from_model(model, tokenizer),
            kvnotes.Engine.from_model(bf16, tokenizer))


def test_bfloat16_engine_writes_bfloat16_notes_and_round_trips(engines, tmp_path):
    _, bf16 = engines
    nb = bf16.prefill("Order status: pending. Policy: refund when delivered.")
    assert nb.keys(0).dtype == torch.bfloat16 and nb.values(0).dtype == torch.bfloat16
    nb.save(tmp_path / "bf16.kvn")
    back = kvnotes.Notebook.load(tmp_path / "bf16.kvn", bf16)
    assert torch.equal(back.keys(0), nb.keys(0))
    logits = bf16.next_logits(back, " Answer:")
    assert torch.isfinite(logits.float()).all()


def test_notebook_of_one_dtype_is_refused_by_another(engines, tmp_path):
    fp32, bf16 = engines
    fp32.prefill("Order status: pending.").save(tmp_path / "fp32.kvn")
    with pytest.raises(NotebookMismatchError, match="float32.*bfloat16.*differing: .*dtype"):
        kvnotes.Notebook.load(tmp_path / "fp32.kvn", bf16)


def test_fingerprint_does_not_depend_on_where_the_weights_live(engines, tokenizer):
    fp32, _ = engines
    moved = copy.deepcopy(fp32.model).to("cpu")  # the same weights, another module instance
    assert ModelFingerprint.of(moved, tokenizer) == fp32.fingerprint
    # the weight sample is hashed as float32 on the CPU, whatever the model's device
    assert "device" not in fp32.fingerprint.to_dict()
