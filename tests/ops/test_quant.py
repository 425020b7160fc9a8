"""Quantized notebooks: int8 round trip, shift, files and skill library, within stated bounds."""

from __future__ import annotations

import math

import pytest
import torch

import kvnotes
from kvnotes.core.errors import NotebookFileError, NotebookMismatchError, PositionError
from kvnotes.core.tiny import ByteTokenizer, tiny_model
from kvnotes.ops.quant import (
    ROUND_TRIP_STEPS,
    SHIFT_STEPS,
    QuantizedNotebook,
    QuantizedTensor,
    quantize,
    quantize_tensor,
)
from kvnotes.ops.store import SkillLibrary

TEXT = "Refund policy: refunds need a receipt and arrive within 14 days. Ask for the order id."
EPS = 1e-6  # float slack on top of the stated bounds


@pytest.fixture(scope="module", params=["llama", "deepseek_v2"])
def engine(request) -> kvnotes.Engine:
    return kvnotes.Engine.from_model(tiny_model(request.param, 256), ByteTokenizer(256))


def error_in_steps(x: torch.Tensor, qt: QuantizedTensor) -> float:
    """Largest ``|x - dequantize|`` in quantization steps of its group."""
    return float(((x.to(torch.float32) - qt.dequantize()).abs() / qt.scale).max())


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_quantize_tensor_round_trip_within_half_a_step(axis):
    torch.manual_seed(0)
    x = torch.randn(1, 3, 17, 16) * torch.logspace(-2, 1, 16)  # channels of very different size
    qt = quantize_tensor(x, axis)
    assert qt.q.dtype == torch.int8
    assert qt.scale.shape == ((1, 3, 17, 1) if axis == "token" else (1, 3, 1, 16))
    assert error_in_steps(x, qt) <= ROUND_TRIP_STEPS + EPS


def test_zero_rows_stay_zero():
    qt = quantize_tensor(torch.zeros(1, 1, 4, 8))
    assert torch.equal(qt.dequantize(), torch.zeros(1, 1, 4, 8))


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_notebook_round_trip_and_shift_within_stated_tolerance(engine, axis):
    nb, there = engine.prefill(TEXT, 0), engine.prefill(TEXT, 29)
    qnb = quantize(nb, axis)
    assert len(qnb) == len(nb) and torch.equal(qnb.positions, nb.positions)
    for layer, (qk, qv) in zip(nb.layers, qnb.layers, strict=True):
        assert error_in_steps(layer.keys, qk) <= ROUND_TRIP_STEPS + EPS
        assert error_in_steps(layer.values, qv) <= ROUND_TRIP_STEPS + EPS
    moved = qnb.shifted(29)
    assert torch.equal(moved.positions, there.positions)
    back = moved.dequantize()
    for i, (old, new) in enumerate(zip(qnb.layers, moved.layers, strict=True)):
        for exact, got, a, b in ((there.keys(i), back.keys(i), old[0], new[0]),
                                 (there.values(i), back.values(i), old[1], new[1])):
            step = max(float(a.scale.max()), float(b.scale.max()))
            assert float((exact - got).abs().max()) <= SHIFT_STEPS * step + 1e-4
    assert SHIFT_STEPS == pytest.approx((math.sqrt(2) + 1) / 2)


def test_quantized_notes_still_predict_like_fp32(engine):
    nb = engine.prefill(TEXT)
    fp32 = engine.next_logits(nb, " Order")
    int8 = engine.next_logits(quantize(nb, "token").dequantize(), " Order")
    assert torch.nn.functional.cosine_similarity(fp32, int8, dim=0) > 0.999


def test_save_load_round_trip_and_errors(engine, tmp_path):
    qnb = quantize(engine.compile(TEXT, name="refunds"), "channel")
    path = qnb.save(tmp_path / "refunds.q8.safetensors")
    fp32_path = engine.compile(TEXT).save(tmp_path / "refunds.safetensors")
    assert path.stat().st_size < 0.4 * fp32_path.stat().st_size
    again = QuantizedNotebook.load(path, engine)
    assert again.axis == "channel" and again.spans == qnb.spans
    assert all(torch.equal(a[0].q, b[0].q) and torch.equal(a[1].scale, b[1].scale)
               for a, b in zip(qnb.layers, again.layers, strict=True))
    with pytest.raises(NotebookFileError, match="use Notebook.load"):
        QuantizedNotebook.load(fp32_path, engine)
    with pytest.raises(NotebookFileError, match="not a kvnotes notebook|unsupported format"):
        kvnotes.Notebook.load(path, engine)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(NotebookFileError):
        QuantizedNotebook.load(path, engine)


def test_load_refuses_another_model(engine, tmp_path):
    path = quantize(engine.prefill(TEXT)).save(tmp_path / "a.q8.safetensors")
    other = kvnotes.Engine.from_model(tiny_model("qwen2", 256), ByteTokenizer(256))
    with pytest.raises(NotebookMismatchError, match="different model"):
        QuantizedNotebook.load(path, other)


def test_unsupported_shift_raises_the_documented_error():
    gpt2 = kvnotes.Engine.from_model(tiny_model("gpt2", 256), ByteTokenizer(256))
    with pytest.raises(PositionError, match="cannot be repositioned"):
        quantize(gpt2.prefill(TEXT)).shifted(3)


def test_skill_library_int8_option(engine, tmp_path):
    with pytest.raises(ValueError, match="quantize must be"):
        SkillLibrary(tmp_path, engine, quantize="int4")
    lib = SkillLibrary(tmp_path, engine, quantize="token")
    plain = SkillLibrary(tmp_path, engine)
    assert lib.path_for(TEXT) != plain.path_for(TEXT)  # int8 entries have their own address
    first = lib.get(TEXT, name="refunds")
    second = SkillLibrary(tmp_path, engine, quantize="token").get(TEXT, name="refunds")
    assert (lib.misses, len(lib)) == (1, 1)
    assert all(torch.equal(first.keys(i), second.keys(i)) for i in range(len(first.layers)))
    assert second.spans[0].name == "refunds" and second.meta["quantized"] == "token"
    nb = engine.compose(["Customer: can I get my money back?\n", second, "\nAgent:"])
    ref = engine.compose(["Customer: can I get my money back?\n", plain.get(TEXT), "\nAgent:"])
    cos = torch.nn.functional.cosine_similarity(engine.next_logits(nb, " Yes"),
                                                engine.next_logits(ref, " Yes"), dim=0)
    assert cos > 0.999
