"""Helpers of the store's tests: real ``redis-server`` processes on loopback ports (started
without persistence on a free port, stopped by their process id), and library entries (real
kvnotes notebook files, made without an engine). The server is
:class:`~kvnotes.serving.store.redis_process.RedisProcess`, the library's own."""

from __future__ import annotations

from pathlib import Path

import torch

from kvnotes.core import files
from kvnotes.serving.library.manifest import ENTRY_FORMAT, ENTRY_VERSION
from kvnotes.serving.store.redis_process import REDIS_SERVER as REDIS_SERVER  # the fixtures'
from kvnotes.serving.store.redis_process import RedisProcess

MODEL = "m0del0000000000000000000"  # a fingerprint id's shape (24 characters)
FINGERPRINT = {"architecture": "LlamaForCausalLM", "model_type": "llama", "config_sha": "c",
               "tokenizer_sha": "t", "weights_sha": "w", "dtype": "float32", "num_layers": 2}


RedisServer = RedisProcess  # the fixtures' name for it


def entry_bytes(folder: Path, key: str, *, tenant: str | None = None, tokens: int = 8,
                width: int = 16, seed: int = 0, name: str = "chunk") -> bytes:
    """A kvnotes skill entry's file bytes: 2 layers of [1, 2 heads, tokens, width] float32."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"token_ids": torch.arange(tokens, dtype=torch.int64) + seed,
               "positions": torch.arange(tokens, dtype=torch.int64)}
    for layer in range(2):
        for kind in ("keys", "values"):
            tensors[f"layers.{layer}.{kind}"] = torch.randn(1, 2, tokens, width, generator=g)
    meta = {"tenant": tenant} if tenant is not None else {}
    header = {"format": ENTRY_FORMAT, "version": ENTRY_VERSION, "fingerprint": FINGERPRINT,
              "scheme": "rope", "length": tokens, "origin": 0, "num_layers": 2,
              "spans": [[name, "skill", 0, tokens]], "meta": meta}
    path = files.write(folder / f"{key}.safetensors", tensors, header)
    data = path.read_bytes()
    path.unlink()
    return data
