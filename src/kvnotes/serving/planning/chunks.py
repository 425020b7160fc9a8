"""A chunk of a request: a span of its prompt that kvnotes may cache on sight.

Each entry of a chat request's ``tools`` and each text part of a message's content is a chunk
(:class:`SeenChunk`): its text, its token ids as laid out in the prompt (the part encoded
alone), and the token ids of the prompt before it (what it was seen after, the prefix it is
compiled behind when learned). The front's reader produces them; the learner counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvnotes.serving.json_types import JsonObject

CHUNK_KINDS = ("tool", "content")


@dataclass(frozen=True, slots=True)
class SeenChunk:
    """One chunk of one request (see the module docstring)."""

    kind: str  # one of CHUNK_KINDS
    text: str
    token_ids: tuple[int, ...]
    # the prompt's token ids before the chunk (BOS included): ``behind[:behind_len]``, so the
    # chunks of one request share one tuple of its ids (a copy each would make a request's
    # memory quadratic in its chunks)
    behind: tuple[int, ...]
    behind_len: int | None = None  # None: all of ``behind``

    @property
    def after_ids(self) -> tuple[int, ...]:
        """The prompt's token ids before the chunk (BOS included)."""
        return self.behind if self.behind_len is None else self.behind[:self.behind_len]

    @property
    def after_len(self) -> int:
        return len(self.behind) if self.behind_len is None else self.behind_len

    def __len__(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> JsonObject:
        return {"kind": self.kind, "tokens": len(self.token_ids), "after": self.after_len}
