"""A skill library: compiled skills stored by content, so each is compiled once per model.

The content address is a pure function of (model fingerprint, position scheme, anchor, token
ids); the fingerprint id is also the folder, a namespace no other model can hit.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kvnotes.engine import Engine
from kvnotes.errors import NotebookFileError
from kvnotes.notebook import Notebook


def skill_key(fingerprint_id: str, scheme: str, anchor: str, token_ids: list[int]) -> str:
    """Content address of a compiled skill."""
    payload = json.dumps([fingerprint_id, scheme, anchor, token_ids]).encode()
    return hashlib.sha256(payload).hexdigest()[:32]


class SkillLibrary:
    """Compiled skills on disk, keyed by content; ``get`` compiles on a miss.

    Example:
        >>> lib = SkillLibrary("skills/", engine)                 # doctest: +SKIP
        >>> skill = lib.get("Refund policy: ...", name="refunds")  # compiled once, then loaded
    """

    def __init__(self, root: str | os.PathLike[str], engine: Engine, *, anchor: str = "auto") -> None:
        self.engine = engine
        self.anchor = ("bos" if engine.adds_bos else "none") if anchor == "auto" else anchor
        self.root = Path(root) / engine.fingerprint.id
        self.hits = 0
        self.misses = 0

    def path_for(self, text: str) -> Path:
        ids = self.engine.encode(text)
        return self.root / f"{skill_key(self.engine.fingerprint.id, self.engine.adapter.name, self.anchor, ids)}.safetensors"

    def __contains__(self, text: str) -> bool:
        return self.path_for(text).is_file()

    def get(self, text: str, *, name: str = "skill") -> Notebook:
        """The compiled skill for ``text``: loaded when stored, else compiled and stored."""
        path = self.path_for(text)
        if path.is_file():
            try:
                skill = Notebook.load(path, self.engine)
                self.hits += 1
                return skill.with_spans([s.__class__(name, "skill", 0, len(skill))]).with_meta(name=name)
            except NotebookFileError:
                path.unlink()  # a damaged entry is a cache miss, never a wrong answer
        self.misses += 1
        skill = self.engine.compile(text, name=name, anchor=self.anchor)
        skill.save(path)
        return skill

    def __len__(self) -> int:
        return len(list(self.root.glob("*.safetensors"))) if self.root.is_dir() else 0
