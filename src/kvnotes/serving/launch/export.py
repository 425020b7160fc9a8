"""A vLLM-ready copy of a kvnotes model folder.

vLLM can read the converted folders kvnotes keeps (safetensors + config + tokenizer), but they
hold float32 weights: the server then casts every tensor at load, with one warning per weight.
The export writes a bfloat16 copy (half the size, what the server runs in) with a config that
says so, plus the tokenizer and chat template, once per source folder.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from kvnotes.core import files
from kvnotes.core.errors import UnknownModelError

_COPY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "chat_template.jinja", "generation_config.json", "tokenizer.model")


def _source_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.glob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}|{st.st_size}|{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def export_hf_dir(model: str = "smollm2-135m", out_dir: str | Path | None = None, *,
                  dtype: str = "bfloat16") -> Path:
    """Write (once) and return a folder vLLM can serve for ``model``.

    ``model`` is anything :func:`kvnotes.core.models.resolve` accepts that resolves to a local
    folder (a bundled alias, a GGUF file, an HF folder). The default target is
    ``$KVNOTES_HOME/vllm/<name>-<dtype>``; an up-to-date export is reused.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from kvnotes.core.models import kvnotes_home, resolve

    source = resolve(model)
    if not isinstance(source, Path):
        raise UnknownModelError(f"{model!r} is a hub id; a server kvnotes launches needs a local "
                                "model (a bundled alias, a .gguf file or an HF folder)")
    weights = sorted(source.glob("*.safetensors"))
    if not weights:
        raise UnknownModelError(f"{source} has no .safetensors weights to export for vLLM")
    name = model if not Path(model).exists() else Path(model).stem
    # one copy per dtype: servers of both dtypes can share a machine without re-exporting
    target = Path(out_dir) if out_dir else kvnotes_home() / "vllm" / f"{name}-{dtype}"
    stamp = target / "kvnotes-export.json"
    digest = _source_digest(source)
    if stamp.is_file():
        info = json.loads(stamp.read_text())
        if info.get("digest") == digest and info.get("dtype") == dtype:
            return target
    torch_dtype = getattr(torch, dtype)
    with files.staged_dir(target) as tmp:
        for w in weights:
            tensors = {k: (v.to(torch_dtype) if v.is_floating_point() else v).contiguous()
                       for k, v in load_file(str(w)).items()}
            save_file(tensors, str(tmp / w.name), metadata={"format": "pt"})
        index = source / "model.safetensors.index.json"
        if index.is_file():
            shutil.copy2(index, tmp / index.name)
        config = json.loads((source / "config.json").read_text())
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for fname in _COPY:
            if (source / fname).is_file():
                shutil.copy2(source / fname, tmp / fname)
        (tmp / "kvnotes-export.json").write_text(
            json.dumps({"source": str(source), "digest": digest, "dtype": dtype}))
    return target
