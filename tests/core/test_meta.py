"""A notebook's meta through its file: the typed keys checked on load, others kept as they came."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

import kvnotes
from kvnotes.core import files
from kvnotes.core.errors import NotebookFileError
from kvnotes.ops.quant import QuantizedNotebook, quantize


def _resaved(path, edit) -> None:
    """``path`` written again with ``edit`` applied to its header's meta (checksum valid)."""
    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["kvnotes"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(header["meta"])
    header.pop("checksum"), header.pop("container")
    files.write(path, tensors, header)


def test_meta_round_trips_and_keeps_keys_it_does_not_name(tiny_llama, tmp_path):
    nb = tiny_llama.prefill(kvnotes.Document(["Order: ", kvnotes.Field("status", "pending")]))
    nb = nb.with_meta(name="orders", prefix_ids=[1, 2], errata=[{"field": "status",
                                                                 "value": "sent"}])
    path = nb.save(tmp_path / "nb.safetensors")
    back = kvnotes.Notebook.load(path, tiny_llama)
    assert back.meta == nb.meta and back.meta["document"]["parts"][1] == [
        "field", "status", "pending"]
    # a file whose meta carries a key this version does not name (a newer writer's) loads
    _resaved(path, lambda meta: meta.update(written_by="a later kvnotes"))
    assert kvnotes.Notebook.load(path, tiny_llama).meta["written_by"] == "a later kvnotes"
    q = quantize(back).save(tmp_path / "q.safetensors")
    assert QuantizedNotebook.load(q, tiny_llama).dequantize().meta["quantized"] == "token"


@pytest.mark.parametrize(("key", "value"), [("prefix_ids", "not ids"), ("name", 3),
                                            ("errata", [{"field": "status"}])])
def test_a_meta_field_of_the_wrong_type_is_refused(tiny_llama, tmp_path, key, value):
    path = tiny_llama.prefill("Order: pending").save(tmp_path / "nb.safetensors")
    _resaved(path, lambda meta: meta.update({key: value}))
    with pytest.raises(NotebookFileError, match=f"(?s)malformed header.*meta.{key}"):
        kvnotes.Notebook.load(path, tiny_llama)
