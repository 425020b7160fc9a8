"""Documents: text made of plain parts and named fields, tokenized with exact field spans.

**Boundary rule.** Each part is tokenized on its own, without special tokens, and the token
lists are joined. A field therefore owns exactly the tokens of its value, and changing a value
changes only those tokens. The price: at a part boundary the ids may differ from tokenizing
the joined string (BPE merges never cross a boundary). Put spaces and punctuation inside the
parts where you want them (``"Status: "`` then ``Field("status", "pending")``); full recompute
in kvnotes always uses the same ids, so comparisons stay exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import kvnotes.core.validate as validate
from kvnotes.core.errors import EmptyInputError, KvnotesError, UnknownFieldError
from kvnotes.core.meta import DocumentRecord


@dataclass(frozen=True, slots=True)
class Field:
    """A named, editable value inside a :class:`Document`."""

    name: str
    value: str

    def __post_init__(self) -> None:
        validate.text(self.name, "field name", allow_empty=False)
        validate.text(self.value, f"field {self.name!r} value")


Part = str | Field


class Document:
    """An ordered list of text parts and named :class:`Field` parts.

    Example:
        >>> doc = Document(["Order status: ", Field("status", "pending"), ".\\n"])
        >>> doc.text
        'Order status: pending.\\n'
        >>> doc.with_value("status", "delivered").text
        'Order status: delivered.\\n'
    """

    __slots__ = ("parts",)

    def __init__(self, parts: Iterable[Part]) -> None:
        self.parts: tuple[Part, ...] = validate.document_parts(parts, Field)
        names = [p.name for p in self.parts if isinstance(p, Field)]
        if len(names) != len(set(names)):
            raise ValueError(f"field names must be unique in a document, got {names}")
        for p in self.parts:
            if not isinstance(p, (str, Field)):
                raise TypeError(f"document parts are str or Field, got {type(p).__name__}")

    def __repr__(self) -> str:
        return f"Document({list(self.parts)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Document) and self.parts == other.parts

    def __hash__(self) -> int:
        return hash(self.parts)

    @property
    def text(self) -> str:
        return "".join(p.value if isinstance(p, Field) else p for p in self.parts)

    @property
    def fields(self) -> dict[str, str]:
        return {p.name: p.value for p in self.parts if isinstance(p, Field)}

    def value(self, name: str) -> str:
        fields = self.fields
        if name not in fields:
            raise UnknownFieldError(
                f"unknown field {name!r}; this document has fields: {sorted(fields)}"
            )
        return fields[name]

    def with_value(self, name: str, value: str) -> Document:
        """A copy with field ``name`` set to ``value`` (the error lists the known fields)."""
        self.value(name)
        return Document(Field(p.name, value) if isinstance(p, Field) and p.name == name else p
                        for p in self.parts)

    def tokenize(self, tokenizer: object) -> tuple[list[int], list[tuple[str, str, int, int]]]:
        """Token ids and ``(name, kind, start, end)`` spans, per the boundary rule above."""
        ids: list[int] = []
        spans: list[tuple[str, str, int, int]] = []
        text_index = 0
        for part in self.parts:
            text = part.value if isinstance(part, Field) else part
            part_ids = encode(tokenizer, text) if text else []
            if isinstance(part, Field):
                spans.append((part.name, "field", len(ids), len(ids) + len(part_ids)))
            elif part_ids:
                spans.append((f"text{text_index}", "text", len(ids), len(ids) + len(part_ids)))
                text_index += 1
            ids.extend(part_ids)
        if not ids:
            raise EmptyInputError("the document has no tokens")
        return ids, spans


def encode(tokenizer: object, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (BOS is the engine's decision)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def added_bos(tokenizer: object) -> int | None:
    """The BOS rule: the BOS id when ``tokenizer(text)`` adds one by default, else None.

    SmolLM2's ``bos_token`` is ``<|im_start|>``, which its tokenizer never adds: no BOS there.
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    probe = tokenizer("a")["input_ids"]  # type: ignore[operator]
    return bos if bos is not None and probe and probe[0] == bos else None


# ---- the document a notebook remembers --------------------------------------------------------
def document_meta(doc: Document, offset: int) -> DocumentRecord:
    """JSON-able record of ``doc`` prefilled with its first token at notebook index ``offset``."""
    parts = [["field", p.name, p.value] if isinstance(p, Field) else ["text", p]
             for p in doc.parts]
    return {"parts": parts, "offset": int(offset)}


def remembered_document(meta: Mapping[str, object]) -> tuple[Document, int]:
    """The document a notebook whose meta is ``meta`` (``nb.meta``) was prefilled from, and the
    index of its first token (the record :func:`document_meta` wrote; a loaded notebook's was
    checked by :mod:`kvnotes.core.files`)."""
    record = meta.get("document")
    if not record or not isinstance(record, dict):
        raise KvnotesError("this notebook does not remember a document, so it has no fields to "
                           "edit; prefill a kvnotes.Document (engine.prefill(doc)) to edit fields")
    parts = [Field(p[1], p[2]) if p[0] == "field" else p[1] for p in record["parts"]]
    return Document(parts), int(record["offset"])
