"""A notebook's ``meta``: what the verbs that made it recorded, as a typed JSON object.

``nb.meta`` is a plain dict (``nb.meta["compose"]["regions"]`` reads as it always did) whose
keys and their types are :class:`NotebookMeta`'s. It is saved in a notebook file's JSON header
as it is, and read back through pydantic (:class:`kvnotes.core.files.FileHeader`): every
field is checked, keys this version does not name are kept as they came (a newer writer's, a
server's).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, with_config
from typing_extensions import TypedDict  # pydantic reads typing.TypedDict only from Python 3.12

from kvnotes.core.records import Json, adapter


class DocumentRecord(TypedDict):
    """``meta["document"]``: the parts of the document a prefill read (``["text", str]`` or
    ``["field", name, value]``) and the notebook index of its first token."""

    parts: list[list[str]]
    offset: int


class Erratum(TypedDict):
    """One field corrected by an erratum (``meta["errata"]``)."""

    field: str
    value: str


@with_config(ConfigDict(extra="allow"))
class NotebookMeta(TypedDict, total=False):
    """Every key a kvnotes verb writes into ``nb.meta``.

    - ``document``: the :class:`~kvnotes.Document` a prefill read (what ``kvnotes.edit`` edits);
    - ``compose``: compose's statistics; ``errata``: the fields corrected by an erratum;
    - a compiled skill's ``kind`` (``"skill"``), ``name``, ``anchor`` (``"bos"`` or ``"none"``),
      ``after_tokens`` (prefix tokens after the BOS), ``prefix_len``, ``prefix_digest`` and
      ``prefix_ids`` (the ids it was compiled behind), and in a library its ``tenant``;
    - ``quantized``: the axis of the int8 notebook this one was dequantized from;
    - ``producer`` and ``kv_dtype``: the server's connector, on an entry it saved.
    """

    document: DocumentRecord
    # compose's statistics (its docstring lists the keys), held loosely: a benchmark's
    # strategy lays its own counts over them
    compose: dict[str, Any]
    errata: list[Erratum]
    kind: str
    name: str
    anchor: str
    after_tokens: int
    prefix_len: int
    prefix_digest: str
    prefix_ids: list[int]
    tenant: str
    quantized: str
    producer: str
    kv_dtype: str


def meta_json(meta: NotebookMeta) -> Json:
    """``meta`` as the JSON object a file's header holds."""
    # python mode: the values are JSON already, and a NaN stays a float as json.dumps writes it
    out: Json = adapter(NotebookMeta).dump_python(meta)
    return out
