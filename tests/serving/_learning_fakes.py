"""A serving folder without an engine for the learner's fast tests: :class:`FakeSkills`
"compiles" a text by writing a file of a given size, at the address its text, prefix and tenant
give (as ``ServingSkills`` does), and can be made to wait inside a compile."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

from kvnotes.serving.library.registry import LearnedEntry, LearnedRegistry
from kvnotes.serving.library.splice import PieceInfo
from kvnotes.serving.planning.chunks import SeenChunk


class FakeSkills:
    """``folder``, ``path_for`` and ``add`` of a serving folder (the learner's use of it);
    a text's token ids are its characters' code points."""

    def __init__(self, folder: Path, nbytes: int = 100) -> None:
        self.folder, self.nbytes = folder, nbytes
        self.gate: threading.Event | None = None  # set: compiles wait for it
        self.entered = threading.Event()  # a compile started
        self.tokenizer = SimpleNamespace(decode=text_of)
        self.engine = SimpleNamespace(tokenizer=self.tokenizer)

    def path_for(self, text: str, *, after: Sequence[int] | None = None,
                 tenant: str | None = None) -> Path:
        key = hashlib.blake2b(f"{tenant}|{list(after or [])}|{text}".encode(),
                              digest_size=8).hexdigest()
        return self.folder / f"{key}.safetensors"

    def add(self, text: str, *, name: str = "skill", after: Sequence[int] | None = None,
            tenant: str | None = None, capped: bool = True) -> PieceInfo:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(60), "the test never opened the gate"
        path = self.path_for(text, after=after, tenant=tenant)
        path.write_bytes(b"\0" * self.nbytes)
        return PieceInfo(path.stem, name, ids(text), 0, tenant, tuple(after or ()))


def ids(text: str) -> tuple[int, ...]:
    return tuple(ord(c) for c in text)


def text_of(token_ids: Sequence[int]) -> str:
    return "".join(chr(t) for t in token_ids)


def seen(text: str, after: str = "head") -> SeenChunk:
    return SeenChunk("tool", text, ids(text), ids(after))


def stored(folder: Path, registry: LearnedRegistry, key: str, tenant: str | None = None,
           nbytes: int = 100, last_used: float = 1.0, **kw: object) -> LearnedEntry:
    """A learned entry with its file, recorded in ``registry``."""
    entry = LearnedEntry(key, tenant, key, "tool", 4, nbytes, last_used=last_used,
                         **kw)  # type: ignore[arg-type]
    (folder / f"{key}.safetensors").write_bytes(b"\0" * nbytes)
    registry.record(entry)
    return entry
