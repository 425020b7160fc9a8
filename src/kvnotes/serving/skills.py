"""Skills a vLLM server can splice: compiled by kvnotes, stored per model, read by the connector.

The skills live in an ordinary :class:`~kvnotes.SkillLibrary` (one folder per model
fingerprint, one content-addressed notebook file per skill); serving adds one manifest::

    ROOT/<model fingerprint id>/serving.json       model shape and RoPE tables, for the connector
    ROOT/<model fingerprint id>/<key>.safetensors  one notebook file per compiled skill

Compilation happens in kvnotes' engine (float32), not in the server: an entry holds the same
notes ``engine.compile`` gives, so a spliced request can be checked token for token against
``engine.compose``. A skill's first token sits at position 0 for a model without BOS, and at 1
for a model whose tokenizer adds BOS (prefilled behind a BOS whose notes are dropped, the sink
convention of DESIGN.md); such models also get a one-token ``bos`` entry at position 0, so a
prompt's leading run starts at token 0. The connector reads entries with the notebook file
checks (format, checksum over header and tensors, fingerprint) and never needs an engine.

Library entries are published atomically and are content-addressed, so a server that rescans
the folder sees a skill completely or not at all.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvnotes.core import files
from kvnotes.core.engine import Engine
from kvnotes.core.errors import NotebookFileError, UnsupportedModelError
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.core.notebook import FILE_FORMAT, FILE_VERSION
from kvnotes.core.positions.rope import RopeAdapter
from kvnotes.ops.store import SkillLibrary, skill_key
from kvnotes.serving.splice import PieceInfo

MANIFEST_NAME = "serving.json"
MANIFEST_FORMAT = "kvnotes.serving-manifest"
SERVABLE_SCHEMES = ("rope",)  # half-split RoPE: the layout vLLM's attention writes keys in


@dataclass(frozen=True, slots=True)
class ServingManifest:
    """What the connector checks the served model against, and the tables it rotates with."""

    fingerprint: dict[str, Any]
    model: str
    scheme: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    bos_id: int | None
    inv_freqs: list[list[float]]  # per layer: RoPE inverse frequencies (float64 values)
    format: str = MANIFEST_FORMAT
    version: int = 1

    def inv_freq(self, layer: int) -> torch.Tensor:
        return torch.tensor(self.inv_freqs[layer], dtype=torch.float64)

    @property
    def fingerprint_obj(self) -> ModelFingerprint:
        return ModelFingerprint.from_dict(self.fingerprint)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def read(cls, folder: str | os.PathLike[str]) -> ServingManifest:
        path = Path(folder) / MANIFEST_NAME
        if not path.is_file():
            raise NotebookFileError(
                f"{folder} has no {MANIFEST_NAME}: prepare the skills folder with "
                "`kvnotes skills add --model M --skills DIR ...` (or `kvnotes serve`) first")
        try:
            data = json.loads(path.read_text("utf-8"))
            if data.get("format") != MANIFEST_FORMAT or data.get("version") != 1:
                raise NotebookFileError(f"{path} is not a kvnotes serving manifest (v1)")
            return cls(**data)
        except (json.JSONDecodeError, TypeError) as err:
            raise NotebookFileError(f"{path} is not a readable serving manifest: {err}") from err


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


def serving_folder(root: str | os.PathLike[str], engine: Engine) -> Path:
    """The library folder of ``engine``'s model under a skill-library root."""
    return Path(root) / engine.fingerprint.id


def manifest_for(engine: Engine) -> ServingManifest:
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
        path = self.folder / MANIFEST_NAME
        text = self.manifest.to_json()
        if not path.is_file() or path.read_text("utf-8") != text:
            tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
            tmp.write_text(text, "utf-8")
            os.replace(tmp, path)  # atomic: a reader sees the old or the new manifest
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
            raise TypeError("a serving skill is a non-empty string")
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
        for path in sorted(self.folder.glob("*.safetensors")):
            try:
                out.append(read_entry(path, self.manifest.fingerprint_obj)[0])
            except NotebookFileError:
                continue
        return out


def read_entry(path: str | os.PathLike[str], fingerprint: ModelFingerprint
               ) -> tuple[PieceInfo, torch.Tensor, torch.Tensor]:
    """``(piece, keys, values)`` of one library entry, with every check of a notebook file;
    keys/values ``[layers, n, kv_heads, head_dim]`` float32 (the layout a paged cache takes)."""
    path = Path(path)
    header, tensors = files.read(path, fingerprint, file_format=FILE_FORMAT,
                                 version=FILE_VERSION, what="skill")
    try:
        ids = tuple(int(t) for t in tensors["token_ids"].tolist())
        origin = int(tensors["positions"][0]) if ids else 0
        spans = header.get("spans") or []
        name = str(spans[0][0]) if spans else path.stem
        num_layers = int(header["num_layers"])
        # stored as the HF cache holds them: [1, kv_heads, n, head_dim] per layer
        keys = torch.stack([tensors[f"layers.{l}.keys"][0].transpose(0, 1)
                            for l in range(num_layers)]).float()
        values = torch.stack([tensors[f"layers.{l}.values"][0].transpose(0, 1)
                              for l in range(num_layers)]).float()
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        raise NotebookFileError(f"{path}: not a skill the server can splice ({err})") from err
    if not ids or keys.shape[1] != len(ids) or keys.shape != values.shape:
        raise NotebookFileError(f"{path}: keys {tuple(keys.shape)} / values "
                                f"{tuple(values.shape)} do not fit {len(ids)} tokens")
    return PieceInfo(path.stem, name, ids, origin), keys, values
