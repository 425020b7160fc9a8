"""kvnotes in a vLLM server: the product side.

- :mod:`~kvnotes.serving.connector`: the vLLM KV connector (the only module that imports vLLM)
  splices published skills into requests salted ``kvnotes-splice``;
- :mod:`~kvnotes.serving.piece_store` and :mod:`~kvnotes.serving.splice`: what it may splice
  and where (tested without vLLM);
- :mod:`~kvnotes.serving.manifest`: what server and clients agree on (the salt, the serving
  manifest, reading an entry), free of the engine;
- :mod:`~kvnotes.serving.skills`: compiling and publishing skills with kvnotes' engine;
- :mod:`~kvnotes.serving.launch`: the one way a server is started (:class:`LaunchConfig`,
  :func:`prepare`), on :mod:`~kvnotes.serving.server` and :mod:`~kvnotes.serving.export`;
- :mod:`~kvnotes.serving.compose_client` and :mod:`~kvnotes.serving.client`: talking to it.

Importing this package imports nothing: vLLM's process imports ``kvnotes.serving.connector``,
and its import closure must stay free of the engine and of transformers. The names below are
loaded on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ComposeClient": "compose_client", "ComposeResult": "compose_client",
    "Launch": "launch", "LaunchConfig": "launch", "LaunchRecord": "launch", "prepare": "launch",
    "export_model": "launch",
    "ServingManifest": "manifest", "SPLICE_SALT": "manifest", "is_splice_salt": "manifest",
    "splice_salt": "manifest", "read_entry": "manifest",
    "ServingSkills": "skills",
    "VLLMServer": "server",
}

__all__ = [  # the names _EXPORTS loads
    "ComposeClient", "ComposeResult", "Launch", "LaunchConfig", "LaunchRecord", "SPLICE_SALT",
    "ServingManifest", "ServingSkills", "VLLMServer", "export_model", "is_splice_salt",
    "prepare", "read_entry", "splice_salt",
]

if TYPE_CHECKING:
    from kvnotes.serving.compose_client import ComposeClient, ComposeResult
    from kvnotes.serving.launch import Launch, LaunchConfig, LaunchRecord, export_model, prepare
    from kvnotes.serving.manifest import (
        SPLICE_SALT,
        ServingManifest,
        is_splice_salt,
        read_entry,
        splice_salt,
    )
    from kvnotes.serving.server import VLLMServer
    from kvnotes.serving.skills import ServingSkills


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvnotes.serving' has no attribute {name!r}")
    value = getattr(import_module(f"kvnotes.serving.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
