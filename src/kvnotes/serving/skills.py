"""Publishing skills for a vLLM server, stored per model.

The skills live in an ordinary :class:`~kvnotes.SkillLibrary` layout (one folder per model
fingerprint, one content-addressed notebook file per skill) beside the serving manifest
(:mod:`kvnotes.serving.library.manifest` describes the folder and reads it without an engine).

Two compilers write the same entries. Offline (``kvnotes skills add`` without ``--server``,
an :class:`~kvnotes.Engine` given), kvnotes' engine compiles them (float32): an entry holds the
notes ``engine.compile`` gives, so a spliced request can be checked token for token against
``engine.compose``. In ``kvnotes serve`` the front holds no weights, only the model's
:class:`~kvnotes.serving.library.model_facts.ModelFacts`: the running server's own prefill
compiles them and its connector saves them (:meth:`ServingSkills.attach`). A skill's first
token sits at position 0 for a model without BOS, and at 1 for a model whose tokenizer adds
BOS (prefilled behind a BOS whose notes are dropped, the attention-sink convention); such
models also get a one-token ``bos`` entry at position 0, so a prompt's leading run starts at
token 0.

Library entries are published atomically and are content-addressed, so a server that rescans
the folder sees a skill completely or not at all.

The manifest records the digests of the model's weight files
(:mod:`kvnotes.serving.library.weights`), so a server running other weights of the same shape (a
fine-tune) is refused at start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.core.document import encode
from kvnotes.core.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    KvnotesError,
    NotebookFileError,
    ServingError,
    UnknownModelError,
    UnknownNameError,
    UnsupportedModelError,
)
from kvnotes.core.positions.rope import RopeAdapter
from kvnotes.serving.library.manifest import (
    ENTRY_SUFFIX,
    ServingManifest,
    entry_paths,
    read_entry,
    splice_salt,
)
from kvnotes.serving.library.model_facts import ModelFacts
from kvnotes.serving.library.skill_variants import (
    DEFAULT_MAX_VARIANTS,
    SkillVariants,
    cap_variants,
    skill_variants,
)
from kvnotes.serving.library.splice import PieceInfo
from kvnotes.serving.library.weights import weight_files, weights_digest
from kvnotes.serving.server_prefill import EntryAddress, PrefillClient, save_by_server

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.ops.store import SkillLibrary

SERVABLE_SCHEMES = ("rope",)  # half-split RoPE: the layout vLLM's attention writes keys in


def check_servable(model: Engine | ModelFacts) -> RopeAdapter:
    """The model's adapter when a server can move its keys exactly; otherwise a clear error."""
    adapter, name = model.adapter, model.name
    if adapter.name not in SERVABLE_SCHEMES or not isinstance(adapter, RopeAdapter):
        raise UnsupportedModelError(
            f"the kvnotes connector splices half-split RoPE caches only; {name} uses the "
            f"{adapter.name!r} position scheme (interleaved RoPE, MLA, M-RoPE, ALiBi and learned "
            "positions lay keys out differently in vLLM). Serve it without --skills.")
    if not adapter.exact_shift:
        raise UnsupportedModelError(
            f"{name}: keys cannot be moved exactly ({adapter.approximate_reason}); the "
            "connector refuses approximate re-rotation. Serve it without --skills.")
    return adapter


def weights_folder(engine: Engine) -> Path | None:
    """The folder of safetensors files ``engine``'s model was loaded from, if it has one (a
    model built in memory, ``Engine.from_model`` of a fresh config, has none)."""
    source = str(getattr(engine.model.config, "_name_or_path", "") or "")
    folder = Path(source) if source else None
    return folder if folder is not None and folder.is_dir() and weight_files(folder) else None


def facts_of(model: Engine | ModelFacts, weights: str | os.PathLike[str] | None = None
             ) -> ModelFacts:
    """``model``'s :class:`ModelFacts` (an engine's read from it; ``weights``: the folder of
    the weights it runs, default the one it was loaded from)."""
    if isinstance(model, ModelFacts):
        return model if weights is None else replace(model, folder=Path(weights))
    check_servable(model)  # before the prefill that reads the key shape
    return ModelFacts.of_engine(model, Path(weights) if weights is not None
                                else weights_folder(model))


def manifest_for(model: Engine | ModelFacts, weights: str | os.PathLike[str] | None = None
                 ) -> ServingManifest:
    """The manifest a server of ``model``'s model checks against (refuses what it cannot
    splice); the same for an engine and for the :class:`ModelFacts` of its folder.

    ``weights``: the folder of the weights ``model`` runs (default: the one it was loaded
    from); its digests go into the manifest. Without one the manifest records none, and a
    server refuses it.
    """
    facts = facts_of(model, weights)
    adapter = check_servable(facts)
    return ServingManifest(
        fingerprint=facts.fingerprint.to_dict(), model=facts.name, scheme=adapter.name,
        num_layers=adapter.num_layers, num_kv_heads=facts.num_kv_heads,
        head_dim=facts.head_dim, vocab_size=facts.vocab_size, bos_id=facts.bos_id,
        inv_freqs=[f.tolist() for f in adapter.inv_freqs],
        weights=weights_digest(facts.folder).to_dict() if facts.folder is not None else None)


class ServingSkills:
    """One model's skills as a server uses them: a skill library plus the serving manifest.

    ``model``: a loaded :class:`~kvnotes.Engine`, which compiles skills in this process
    (offline, float32), or, with no weights here, the model's :class:`ModelFacts` or its name
    (an alias, ``.gguf`` file or folder: a child process reads the facts, so that transformers'
    model classes stay out of a long-lived server; only the tokenizer is loaded here): then the
    running server's own prefill compiles its skills once :meth:`attach` gave it one. ``weights``:
    the folder of ``*.safetensors`` files the model runs, whose digests the manifest records
    (default: the folder it was read from).

    Example:
        >>> skills = ServingSkills("skills/", engine)                       # doctest: +SKIP
        >>> skills.add("REFUNDS: unworn items within 30 days ...", name="refunds")  # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str], model: Engine | ModelFacts | str, *,
                 weights: str | os.PathLike[str] | None = None,
                 max_variants: int = DEFAULT_MAX_VARIANTS) -> None:
        if isinstance(max_variants, bool) or not isinstance(max_variants, int) \
                or max_variants < 1:
            raise InvalidArgumentError(f"max_variants must be at least 1, got {max_variants!r}")
        if isinstance(model, str):
            self._engine = None
            self.manifest, self.tokenizer = _read_by_child(model, weights)
        else:
            self._engine = None if isinstance(model, ModelFacts) else model
            facts = facts_of(model, weights)
            # refuses a model the connector cannot splice; records the weights' digests
            self.manifest, self.tokenizer = manifest_for(facts), facts.tokenizer
        self.max_variants = max_variants
        self.bos_id = self.manifest.bos_id
        # BOS models: skills prefilled behind a BOS (dropped), so they keep positions 1..L
        self.anchor = "bos" if self.bos_id is not None else "none"
        self._library: SkillLibrary | None = None
        if self._engine is not None:  # imported here: the engine's modules are heavy
            from kvnotes.ops.store import SkillLibrary

            self._library = SkillLibrary(root, self._engine, anchor=self.anchor)
        self.folder = Path(root) / self.manifest.fingerprint_obj.id
        self.folder.mkdir(parents=True, exist_ok=True)
        self.manifest.write(self.folder)
        self.address = EntryAddress.of(self.manifest)
        self.server: PrefillClient | None = None
        if self._engine is not None and self.bos_id is not None:
            self._add_bos(self.bos_id)

    @property
    def offline(self) -> bool:
        """True when this process compiles (an engine was given), False when the attached
        server does."""
        return self._engine is not None

    @property
    def engine(self) -> Engine:
        """The engine that compiles here; :class:`~kvnotes.ServingError` without one."""
        if self._engine is None:
            raise ServingError("this skill library has no engine: its server compiles")
        return self._engine

    @property
    def library(self) -> SkillLibrary:
        """The engine's skill library; :class:`~kvnotes.ServingError` without an engine."""
        if self._library is None:
            raise ServingError("this skill library has no engine: its server compiles")
        return self._library

    def attach(self, client: PrefillClient, kv_dtype: str = "float32") -> None:
        """Compile from now on by the server ``client`` sends to (its connector saves the
        entries into this folder; ``kv_dtype``: the server's, the entries' numerics)."""
        self.address = EntryAddress.of(self.manifest, kv_dtype)
        self.server = client

    def start_entry(self) -> None:
        """The BOS alone at position 0, compiled by the attached server (a model without BOS
        has none). :meth:`attach` first; an engine's is written at construction."""
        bos = self.bos_id
        if bos is None or self.offline:
            return
        save_by_server(self.folder, self._server(), self.address.start_key(bos), [], [bos],
                       "bos", None)

    def add(self, text: str, *, name: str = "skill",
            after: str | Sequence[int] | None = None, tenant: str | None = None,
            capped: bool = True) -> PieceInfo:
        """Compile ``text`` (once: the library keeps it) and publish it to running servers.

        ``after``: compile it behind this prefix (text, BOS added per the library's anchor, or
        token ids taken as given, BOS included), typically the system header the requests start
        with (``engine.compile(text, after=...)``): its notes then saw the header, as they will
        in the prompt, and a skill placed right after the header is moved by 0 positions. Each
        anchoring is its own entry, a *variant* of the skill (e.g. behind the header and the
        skill that precedes it: ``kvnotes skills add --after NAME``); the server splices the
        variant whose prefix the prompt ends with (:func:`kvnotes.core.variants.variant_rank`).
        Beyond ``max_variants`` entries of one skill, the oldest are deleted (``capped=False``:
        none is; the learner bounds its learned entries itself, least recently used first, and
        never deletes the operator's).

        ``tenant``: whose entry it is (None: the operator's, spliced for every tenant). A
        tenant's entry is spliced only into that tenant's requests, and its address includes
        the tenant, so two tenants never share one.

        Without an engine, the attached server compiles it (:meth:`attach`); a
        :class:`~kvnotes.ServingError` when none is.
        """
        if not isinstance(text, str) or not text:
            raise ArgumentTypeError(f"a serving skill is a non-empty string, not {text!r}")
        splice_salt(tenant)  # the tenant's spelling rule
        if not self.offline:
            info = self._server_add(text, name, self._after_ids(after), tenant)
        else:
            skill = self.library.get(text, name=name, after=after, tenant=tenant)
            meta_ids = skill.meta.get("prefix_ids")
            behind = tuple(int(t) for t in meta_ids) if isinstance(meta_ids, list) else ()
            info = PieceInfo(self.path_for(text, after=after, tenant=tenant).stem, name,
                             tuple(int(t) for t in skill.token_ids.tolist()),
                             int(skill.positions[0]), tenant, behind)
        if capped:
            cap_variants(self.folder, self.manifest.fingerprint_obj, info.token_ids, tenant,
                         self.max_variants, keep=info.key)
        return info

    def _server_add(self, text: str, name: str, after: list[int], tenant: str | None
                    ) -> PieceInfo:
        ids = encode(self.tokenizer, text)
        if not ids:
            raise ArgumentTypeError(f"a serving skill has tokens: {text!r} has none")
        key, lead = self.address.key(ids, after, tenant), self.address.lead(after)
        save_by_server(self.folder, self._server(), key, lead, ids, name, tenant)
        return PieceInfo(key, name, tuple(ids), len(lead), tenant, tuple(lead))

    def _server(self) -> PrefillClient:
        if self.server is None:
            raise ServingError(
                "no model is loaded in this process and no server is attached to compile "
                "skills: register them through the running server (`kvnotes skills add "
                "--server URL`), or give ServingSkills an engine")
        return self.server

    def _lead(self, header: str | None) -> list[int]:
        """The anchor (BOS per the library) and ``header``'s ids when given."""
        bos = [self.bos_id] if self.bos_id is not None else []
        return [*bos, *(encode(self.tokenizer, header) if header else [])]

    def _after_ids(self, after: str | Sequence[int] | None) -> list[int]:
        """The prefix a skill is compiled behind, as ids (``SkillLibrary``'s rule)."""
        if after is None:
            return []
        return self._lead(after) if isinstance(after, str) else [int(t) for t in after]

    def after_skill(self, name: str, *, header: str | None = None) -> list[int]:
        """The prefix a variant of a skill that follows skill ``name`` is compiled behind: the
        anchor (BOS per the library), ``header``'s ids when given, then ``name``'s tokens as a
        prompt lays them out (each part encoded alone). :class:`UnknownNameError` when no
        operator entry is called ``name``."""
        groups = [g for g in self.variants() if g.tenant is None]
        found = next((g for g in groups if name in {v.piece.name for v in g.variants}), None)
        if found is None:
            raise UnknownNameError("skill", name, sorted({g.name for g in groups}))
        return [*self._lead(header), *found.token_ids]

    def variants(self) -> list[SkillVariants]:
        """The folder's skills, each with its variants and their bytes on disk."""
        return skill_variants(self.folder, self.manifest.fingerprint_obj)

    def path_for(self, text: str, *, after: str | Sequence[int] | None = None,
                 tenant: str | None = None) -> Path:
        """The file :meth:`add` publishes ``text`` to (it may not exist yet)."""
        if self.offline:
            return self.library.path_for(text, after=after, tenant=tenant)
        key = self.address.key(encode(self.tokenizer, text), self._after_ids(after), tenant)
        return self.entry_path(key)

    def entry_path(self, key: str) -> Path:
        """The file of the entry whose key (file stem) is ``key``."""
        return self.folder / f"{key}{ENTRY_SUFFIX}"

    def _add_bos(self, bos: int) -> None:
        """The BOS alone at position 0 (exact: that is what every BOS-led prompt starts with)."""
        path = self.entry_path(self.address.start_key(bos))
        if not path.is_file():
            nb = self.engine.prefill([bos], bos=False, name="bos", kind="skill")
            nb.with_meta(kind="skill", name="bos", anchor="start").save(path)

    def entries(self) -> list[PieceInfo]:
        out = []
        for path in entry_paths(self.folder):
            try:
                out.append(read_entry(path, self.manifest.fingerprint_obj)[0])
            except NotebookFileError:
                continue
        return out


def _read_by_child(model: str, weights: str | os.PathLike[str] | None
                   ) -> tuple[ServingManifest, Any]:
    """``model``'s manifest, read by a child process, and its tokenizer, loaded here; the
    child's :class:`~kvnotes.KvnotesError` is raised here as the same class."""
    from transformers import AutoTokenizer

    code = "import sys, kvnotes.serving.skills as s; s.print_manifest(*sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, model, str(weights or "")],
                          capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise ServingError(f"reading {model!r}'s facts failed:\n{done.stderr[-2000:]}")
    reply = json.loads(lines[-1])
    if "error" in reply:  # what ModelFacts.read and check_servable raise, by name
        kinds = (UnknownModelError, UnsupportedModelError, NotebookFileError)
        raise {k.__name__: k for k in kinds}.get(reply["error"], ServingError)(reply["message"])
    return ServingManifest(**reply["manifest"]), AutoTokenizer.from_pretrained(reply["folder"])


def print_manifest(model: str, weights: str) -> None:
    """The child of :func:`_read_by_child`: prints the manifest and the folder the tokenizer
    is read from as one JSON line, or the error."""
    try:
        facts = ModelFacts.read(model)
        print(json.dumps({"manifest": asdict(manifest_for(facts, weights or None)),
                          "folder": str(facts.folder)}))
    except KvnotesError as err:
        print(json.dumps({"error": type(err).__name__, "message": str(err)}))
