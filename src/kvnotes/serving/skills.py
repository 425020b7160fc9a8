"""Publishing skills for a vLLM server: compiled by kvnotes' engine, stored per model.

The skills live in an ordinary :class:`~kvnotes.SkillLibrary` (one folder per model
fingerprint, one content-addressed notebook file per skill) beside the serving manifest
(:mod:`kvnotes.serving.library.manifest` describes the folder and reads it without an engine).

Compilation happens in kvnotes' engine (float32), not in the server: an entry holds the same
notes ``engine.compile`` gives, so a spliced request can be checked token for token against
``engine.compose``. A skill's first token sits at position 0 for a model without BOS, and at 1
for a model whose tokenizer adds BOS (prefilled behind a BOS whose notes are dropped, the
attention-sink convention); such models also get a one-token ``bos`` entry at position 0, so a
prompt's leading run starts at token 0.

Library entries are published atomically and are content-addressed, so a server that rescans
the folder sees a skill completely or not at all.

The manifest records the digests of the weights the engine was loaded from
(:mod:`kvnotes.serving.library.weights`), so a server running other weights of the same shape (a
fine-tune) is refused at start.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from kvnotes.core.engine import Engine
from kvnotes.core.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    NotebookFileError,
    UnknownNameError,
    UnsupportedModelError,
)
from kvnotes.core.positions.rope import RopeAdapter
from kvnotes.ops.store import SkillLibrary, skill_key
from kvnotes.serving.library.manifest import (
    ENTRY_SUFFIX,
    ServingManifest,
    entry_paths,
    read_entry,
    splice_salt,
)
from kvnotes.serving.library.skill_variants import (
    DEFAULT_MAX_VARIANTS,
    SkillVariants,
    cap_variants,
    skill_variants,
)
from kvnotes.serving.library.splice import PieceInfo
from kvnotes.serving.library.weights import weight_files, weights_digest

SERVABLE_SCHEMES = ("rope",)  # half-split RoPE: the layout vLLM's attention writes keys in


def check_servable(engine: Engine) -> RopeAdapter:
    """The engine's adapter when a server can move its keys exactly; otherwise a clear error."""
    adapter = engine.adapter
    if adapter.name not in SERVABLE_SCHEMES or not isinstance(adapter, RopeAdapter):
        raise UnsupportedModelError(
            f"the kvnotes connector splices half-split RoPE caches only; {engine.name} uses the "
            f"{adapter.name!r} position scheme (interleaved RoPE, MLA, M-RoPE, ALiBi and learned "
            "positions lay keys out differently in vLLM). Serve it without --skills.")
    if not adapter.exact_shift:
        raise UnsupportedModelError(
            f"{engine.name}: keys cannot be moved exactly ({adapter.approximate_reason}); the "
            "connector refuses approximate re-rotation. Serve it without --skills.")
    return adapter


def weights_folder(engine: Engine) -> Path | None:
    """The folder of safetensors files ``engine``'s model was loaded from, if it has one (a
    model built in memory, ``Engine.from_model`` of a fresh config, has none)."""
    source = str(getattr(engine.model.config, "_name_or_path", "") or "")
    folder = Path(source) if source else None
    return folder if folder is not None and folder.is_dir() and weight_files(folder) else None


def manifest_for(engine: Engine, weights: str | os.PathLike[str] | None = None
                 ) -> ServingManifest:
    """The manifest a server of ``engine``'s model checks against (refuses what it cannot splice).

    ``weights``: the folder of the weights ``engine`` runs (default: the one it was loaded
    from); its digests go into the manifest. Without one the manifest records none, and a
    server refuses it.
    """
    adapter = check_servable(engine)
    folder = Path(weights) if weights is not None else weights_folder(engine)
    cfg = adapter.config
    # the cache's own shapes, whatever the config calls them: one token prefilled
    k = engine.prefill(engine.encode(".")[:1], bos=False).keys(0)  # [1, kv_heads, 1, head_dim]
    return ServingManifest(
        fingerprint=engine.fingerprint.to_dict(), model=engine.name, scheme=adapter.name,
        num_layers=adapter.num_layers, num_kv_heads=int(k.shape[1]), head_dim=int(k.shape[-1]),
        vocab_size=int(getattr(cfg, "vocab_size", 0) or len(engine.tokenizer)),
        bos_id=engine.bos_id, inv_freqs=[f.tolist() for f in adapter.inv_freqs],
        weights=weights_digest(folder).to_dict() if folder is not None else None)


class ServingSkills:
    """One model's skills as a server uses them: a skill library plus the serving manifest.

    ``weights``: the folder of ``*.safetensors`` files ``engine`` runs, whose digests the
    manifest records (default: the folder the engine was loaded from).

    Example:
        >>> skills = ServingSkills("skills/", engine)                       # doctest: +SKIP
        >>> skills.add("REFUNDS: unworn items within 30 days ...", name="refunds")  # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str], engine: Engine, *,
                 weights: str | os.PathLike[str] | None = None,
                 max_variants: int = DEFAULT_MAX_VARIANTS) -> None:
        if isinstance(max_variants, bool) or not isinstance(max_variants, int) \
                or max_variants < 1:
            raise InvalidArgumentError(f"max_variants must be at least 1, got {max_variants!r}")
        self.engine = engine
        self.max_variants = max_variants
        # refuses a model the connector cannot splice; records the weights' digests
        self.manifest = manifest_for(engine, weights)
        # BOS models: skills prefilled behind a BOS (dropped), so they keep positions 1..L
        self.library = SkillLibrary(root, engine, anchor="bos" if engine.bos_id is not None
                                    else "none")
        self.folder = self.library.root
        self.folder.mkdir(parents=True, exist_ok=True)
        self.manifest.write(self.folder)
        if engine.bos_id is not None:
            self._add_bos(engine.bos_id)

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
        """
        if not isinstance(text, str) or not text:
            raise ArgumentTypeError(f"a serving skill is a non-empty string, not {text!r}")
        splice_salt(tenant)  # the tenant's spelling rule
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

    def after_skill(self, name: str, *, header: str | None = None) -> list[int]:
        """The prefix a variant of a skill that follows skill ``name`` is compiled behind: the
        anchor (BOS per the library), ``header``'s ids when given, then ``name``'s tokens as a
        prompt lays them out (each part encoded alone). :class:`UnknownNameError` when no
        operator entry is called ``name``."""
        groups = [g for g in self.variants() if g.tenant is None]
        found = next((g for g in groups if name in {v.piece.name for v in g.variants}), None)
        if found is None:
            raise UnknownNameError("skill", name, sorted({g.name for g in groups}))
        lead = self.engine.anchor_ids(header, anchor=self.library.anchor)
        return [*lead, *found.token_ids]

    def variants(self) -> list[SkillVariants]:
        """The folder's skills, each with its variants and their bytes on disk."""
        return skill_variants(self.folder, self.manifest.fingerprint_obj)

    def path_for(self, text: str, *, after: str | Sequence[int] | None = None,
                 tenant: str | None = None) -> Path:
        """The file :meth:`add` publishes ``text`` to (it may not exist yet)."""
        return self.library.path_for(text, after=after, tenant=tenant)

    def entry_path(self, key: str) -> Path:
        """The file of the entry whose key (file stem) is ``key``."""
        return self.folder / f"{key}{ENTRY_SUFFIX}"

    def _add_bos(self, bos: int) -> None:
        """The BOS alone at position 0 (exact: that is what every BOS-led prompt starts with)."""
        key = skill_key(self.engine.fingerprint.id, self.engine.adapter.name, "start", [bos])
        path = self.folder / f"{key}.safetensors"
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

