"""The agent's skill documents (package data) and their compiled notes, compiled once per model."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvnotes.core.engine import Engine
from kvnotes.core.errors import UnknownSkillError
from kvnotes.core.models import kvnotes_home
from kvnotes.core.notebook import Notebook
from kvnotes.ops.store import SkillLibrary


def skill_names() -> list[str]:
    """The names of the bundled skill documents (``skills/<name>.txt``)."""
    folder = resources.files("kvnotes.apps.agent") / "skills"
    return sorted(p.name[:-4] for p in folder.iterdir() if p.name.endswith(".txt"))


def skill_text(name: str) -> str:
    """A skill document as it is compiled: the file's text ending in one blank line."""
    names = skill_names()
    if name not in names:
        raise UnknownSkillError(name, names)
    text = (resources.files("kvnotes.apps.agent") / "skills" / f"{name}.txt").read_text("utf-8")
    return text.rstrip() + "\n\n"


def default_skill_root() -> Path:
    return kvnotes_home() / "skills"


@dataclass(frozen=True, slots=True)
class SkillNotes:
    """A skill's compiled notes, and whether getting them compiled it (it was neither in the
    library nor already read by this book)."""

    notes: Notebook
    compiled: bool


class SkillBook:
    """The bundled skills for one engine: texts, token ids, and compiled notes.

    Notes come from a :class:`~kvnotes.ops.store.SkillLibrary` (content-addressed on disk), so
    each skill is compiled once per model and loaded on later runs; within a process each
    skill is read once and kept.

    Example:
        >>> import tempfile
        >>> book = SkillBook(engine, tempfile.mkdtemp())  # default folder: the kvnotes home's
        >>> book.entry("refunds").compiled                # compiled and stored in the library
        True
        >>> book.entry("refunds").compiled                # then kept
        False
    """

    def __init__(self, engine: Engine, root: str | os.PathLike[str] | None = None) -> None:
        self.engine = engine
        self.library = SkillLibrary(root if root is not None else default_skill_root(), engine)
        self.names = skill_names()
        self._notes: dict[str, Notebook] = {}
        self._ids: dict[str, list[int]] = {}
        self.compile_s = 0.0  # time spent getting notes from the library (compile or load)

    def check(self, name: str) -> None:
        if name not in self.names:
            raise UnknownSkillError(name, self.names)

    def text(self, name: str) -> str:
        self.check(name)
        return skill_text(name)

    def token_ids(self, name: str) -> list[int]:
        """The skill's token ids, exactly those its notes hold."""
        if name not in self._ids:
            self._ids[name] = self.engine.encode(self.text(name))
        return self._ids[name]

    def notes(self, name: str, *, after: str | Sequence[int] | None = None) -> Notebook:
        """The compiled skill (a library hit when compiled before for this model); ``after``:
        compiled behind that prefix (text, such as the agent's header, or token ids taken as
        given), its own library entry."""
        return self.entry(name, after=after).notes

    def entry(self, name: str, *, after: str | Sequence[int] | None = None) -> SkillNotes:
        """:meth:`notes`, saying whether this call compiled them."""
        if after is None:
            key = name
        elif isinstance(after, str):
            key = f"{name}|after:{after}"
        else:
            after = [int(i) for i in after]
            key = f"{name}|after-ids:{','.join(map(str, after))}"
        return self._compiled(key, self.text(name), name=name, after=after)

    def header(self, text: str) -> Notebook:
        """The agent's fixed header, compiled like a skill (it opens every notebook)."""
        return self.header_entry(text).notes

    def header_entry(self, text: str) -> SkillNotes:
        """:meth:`header`, saying whether this call compiled it."""
        return self._compiled(f"header:{text}", text, name="header")

    def _compiled(self, key: str, text: str, name: str | None = None,
                  after: str | Sequence[int] | None = None) -> SkillNotes:
        if key in self._notes:
            return SkillNotes(self._notes[key], compiled=False)
        t0 = time.perf_counter()
        misses = self.library.misses  # the library tells a compile from a load by this count
        self._notes[key] = self.library.get(text, name=name or key, after=after)
        self.compile_s += time.perf_counter() - t0
        return SkillNotes(self._notes[key], compiled=self.library.misses > misses)

    def prepare(self, names: list[str] | None = None, *,
                after: str | Sequence[int] | None = None) -> None:
        """Compile or load every skill up front (so no turn pays for it)."""
        for name in names if names is not None else self.names:
            self.notes(name, after=after)
