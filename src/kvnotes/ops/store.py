"""A skill library: compiled skills stored by content, so each is compiled once per model.

The content address is a pure function of (model fingerprint, position scheme, anchor, token
ids); the fingerprint id is also the folder, a namespace no other model can hit.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kvnotes.core.engine import Engine
from kvnotes.core.errors import NotebookFileError
from kvnotes.core.notebook import Notebook, Span


def skill_key(fingerprint_id: str, scheme: str, anchor: str, token_ids: list[int],
              quantize: str | None = None) -> str:
    """Content address of a compiled skill (int8 entries get their own addresses)."""
    parts: list[object] = [fingerprint_id, scheme, anchor, token_ids]
    payload = json.dumps(parts + [f"int8-{quantize}"] if quantize else parts).encode()
    return hashlib.sha256(payload).hexdigest()[:32]


class SkillLibrary:
    """Compiled skills on disk, keyed by content; ``get`` compiles on a miss.

    Example:
        >>> lib = SkillLibrary("skills/", engine)                 # doctest: +SKIP
        >>> skill = lib.get("Refund policy: ...", name="refunds")  # compiled once, then loaded
    """

    def __init__(self, root: str | os.PathLike[str], engine: Engine, *, anchor: str = "auto",
                 quantize: str | None = None) -> None:
        """``quantize="token"`` or ``"channel"`` stores skills as int8 (see :mod:`kvnotes.ops.quant`):
        about a quarter of the disk, and ``get`` always returns the dequantized skill."""
        if quantize not in (None, "token", "channel"):
            raise ValueError(f"quantize must be None, 'token' or 'channel', got {quantize!r}")
        self.quantize = quantize
        self.engine = engine
        self.anchor = ("bos" if engine.adds_bos else "none") if anchor == "auto" else anchor
        self.root = Path(root) / engine.fingerprint.id
        self.hits = 0
        self.misses = 0

    def path_for(self, text: str) -> Path:
        ids = self.engine.encode(text)
        key = skill_key(self.engine.fingerprint.id, self.engine.adapter.name, self.anchor, ids,
                        self.quantize)
        return self.root / f"{key}.safetensors"

    def __contains__(self, text: str) -> bool:
        return self.path_for(text).is_file()

    def get(self, text: str, *, name: str = "skill") -> Notebook:
        """The compiled skill for ``text``: loaded when stored, else compiled and stored."""
        path = self.path_for(text)
        if path.is_file():
            try:
                skill = (self._load_int8(path) if self.quantize
                         else Notebook.load(path, self.engine))
                self.hits += 1
                return skill.with_spans([Span(name, "skill", 0, len(skill))]).with_meta(name=name)
            except NotebookFileError:
                path.unlink()  # a damaged entry is a cache miss, never a wrong answer
        self.misses += 1
        skill = self.engine.compile(text, name=name, anchor=self.anchor)
        if self.quantize:
            from kvnotes.ops.quant import quantize

            stored = quantize(skill, self.quantize)
            stored.save(path)
            return stored.dequantize()  # a hit and a miss give the same notes
        skill.save(path)
        return skill

    def _load_int8(self, path: Path) -> Notebook:
        from kvnotes.ops.quant import QuantizedNotebook

        return QuantizedNotebook.load(path, self.engine).dequantize()

    def __len__(self) -> int:
        return len(list(self.root.glob("*.safetensors"))) if self.root.is_dir() else 0
