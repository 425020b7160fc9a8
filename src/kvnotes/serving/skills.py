"""Publishing skills for a vLLM server: compiled by kvnotes' engine, stored per model.

The skills live in an ordinary :class:`~kvnotes.SkillLibrary` (one folder per model
fingerprint, one content-addressed notebook file per skill) beside the serving manifest
(:mod:`kvnotes.serving.manifest` describes the folder and reads it without an engine).

Compilation happens in kvnotes' engine (float32), not in the server: an entry holds the same
notes ``engine.compile`` gives, so a spliced request can be checked token for token against
``engine.compose``. A skill's first token sits at position 0 for a model without BOS, and at 1
for a model whose tokenizer adds BOS (prefilled behind a BOS whose notes are dropped, the
attention-sink convention); such models also get a one-token ``bos`` entry at position 0, so a
prompt's leading run starts at token 0.

Library entries are published atomically and are content-addressed, so a server that rescans
the folder sees a skill completely or not at all.
"""

from __future__ import annotations

import os

from kvnotes.core.engine import Engine
from kvnotes.core.errors import ArgumentTypeError, NotebookFileError, UnsupportedModelError
from kvnotes.core.positions.rope import RopeAdapter
from kvnotes.ops.store import SkillLibrary, skill_key
from kvnotes.serving.manifest import ServingManifest, entry_paths, read_entry
from kvnotes.serving.splice import PieceInfo

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


def manifest_for(engine: Engine) -> ServingManifest:
    """The manifest a server of ``engine``'s model checks against (refuses what it cannot splice)."""
    adapter = check_servable(engine)
    cfg = adapter.config
    # the cache's own shapes, whatever the config calls them: one token prefilled
    k = engine.prefill(engine.encode(".")[:1], bos=False).keys(0)  # [1, kv_heads, 1, head_dim]
    return ServingManifest(
        fingerprint=engine.fingerprint.to_dict(), model=engine.name, scheme=adapter.name,
        num_layers=adapter.num_layers, num_kv_heads=int(k.shape[1]), head_dim=int(k.shape[-1]),
        vocab_size=int(getattr(cfg, "vocab_size", 0) or len(engine.tokenizer)),
        bos_id=engine.bos_id, inv_freqs=[f.tolist() for f in adapter.inv_freqs])


class ServingSkills:
    """One model's skills as a server uses them: a skill library plus the serving manifest.

    Example:
        >>> skills = ServingSkills("skills/", engine)                       # doctest: +SKIP
        >>> skills.add("REFUNDS: unworn items within 30 days ...", name="refunds")  # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str], engine: Engine) -> None:
        self.engine = engine
        self.manifest = manifest_for(engine)  # refuses a model the connector cannot splice
        # BOS models: skills prefilled behind a BOS (dropped), so they keep positions 1..L
        self.library = SkillLibrary(root, engine, anchor="bos" if engine.bos_id is not None
                                    else "none")
        self.folder = self.library.root
        self.folder.mkdir(parents=True, exist_ok=True)
        self.manifest.write(self.folder)
        if engine.bos_id is not None:
            self._add_bos(engine.bos_id)

    def add(self, text: str, *, name: str = "skill", after: str | None = None) -> PieceInfo:
        """Compile ``text`` (once: the library keeps it) and publish it to running servers.

        ``after``: compile it behind this prefix, typically the system header the requests
        start with (``engine.compile(text, after=...)``): its notes then saw the header, as they
        will in the prompt, and a skill placed right after the header is moved by 0 positions.
        Each anchoring is its own entry; the server prefers, among pieces with the same tokens,
        the one prefilled at the very position it is placed at.
        """
        if not isinstance(text, str) or not text:
            raise ArgumentTypeError(f"a serving skill is a non-empty string, not {text!r}")
        skill = self.library.get(text, name=name, after=after)
        return PieceInfo(self.library.path_for(text, after=after).stem, name,
                         tuple(int(t) for t in skill.token_ids.tolist()),
                         int(skill.positions[0]))

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

