"""kvnotes in a vLLM server: the product side, laid out by where the code runs.

- ``vllm/``: what runs inside vLLM's process: the KV connector (:mod:`.vllm.connector`, the
  only code that imports vLLM), its scheduler plans, the worker's KV writer and the start-up
  checks. Its import closure holds only ``kvnotes.core``'s light modules, ``library/`` and
  ``planning/``: never the engine or transformers (tests/core/test_layers.py).
- ``library/``: a serving-skills folder as every side reads it: the manifest and salts, the
  piece store that follows the folder, the pieces' index and where a server may splice them
  (leading runs, splice ranges, slots), the served weights' digest. Free of the engine.
- ``planning/``: pure planning shared by the front and the compose client: phased repair, the
  prompt layout, matching registered skills in text, reading one OpenAI
  request and turning it into vLLM request bodies. Tested without a server.
- ``front/``: the OpenAI-compatible front that plans ordinary requests.
- ``launch/``: the one way a server is started (:class:`LaunchConfig`, :func:`prepare`): the
  vLLM child process and the vLLM-ready model export; :mod:`~kvnotes.serving.vllm_endpoints` is the
  loopback client of vLLM's own endpoints (health, metrics, models).
- :mod:`~kvnotes.serving.skills` (compiling and publishing skills with kvnotes' engine) and
  :mod:`~kvnotes.serving.compose_client` (a client that sends composed, phased requests).

Importing this package imports nothing: vLLM's process imports ``kvnotes.serving.vllm.connector``,
and its import closure must stay free of the engine and of transformers. The names below are
loaded on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ComposeClient": "compose_client", "ComposeResult": "compose_client",
    "Launch": "launch.launcher", "LaunchConfig": "launch.launcher",
    "LaunchRecord": "launch.launcher", "prepare": "launch.launcher",
    "export_model": "launch.launcher",
    "ServingManifest": "library.manifest", "SPLICE_SALT": "library.manifest",
    "splice_salt": "library.manifest", "SpliceRequest": "protocol",
    "read_entry": "library.manifest",
    "ServingSkills": "skills",
    "VLLMServer": "launch.process",
}

__all__ = [  # the names _EXPORTS loads
    "ComposeClient", "ComposeResult", "Launch", "LaunchConfig", "LaunchRecord", "SPLICE_SALT",
    "ServingManifest", "ServingSkills", "SpliceRequest", "VLLMServer", "export_model",
    "prepare", "read_entry", "splice_salt",
]

if TYPE_CHECKING:
    from kvnotes.serving.compose_client import ComposeClient, ComposeResult
    from kvnotes.serving.launch.launcher import Launch, LaunchConfig, LaunchRecord, export_model, prepare
    from kvnotes.serving.launch.process import VLLMServer
    from kvnotes.serving.library.manifest import (
        SPLICE_SALT,
        ServingManifest,
        read_entry,
        splice_salt,
    )
    from kvnotes.serving.protocol import SpliceRequest
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
