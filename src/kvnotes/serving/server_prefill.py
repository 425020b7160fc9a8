"""Compiling an entry by the running server's own prefill, without a model in this process.

A compile request is an ordinary completion request to vLLM (the chunk's ids behind its anchor,
``max_tokens`` 1, answered to no client) carrying a
:class:`~kvnotes.serving.protocol.SaveRequest`; kvnotes' connector saves that request's KV for
the chunk's range into the entry file :class:`EntryAddress` names. The registered skills
(:mod:`kvnotes.serving.skills`) and the learner (:mod:`kvnotes.serving.learning.compiles`)
both compile this way.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvnotes.serving.library.manifest import ENTRY_SUFFIX, ServingManifest
from kvnotes.serving.protocol import SaveRequest

COMPLETIONS = "/v1/completions"  # vLLM's route (kvnotes.serving.front.vllm_client's too)


class SaveFailed(RuntimeError):
    """A compile by the server ran but left no entry (its save could not be written, or the
    request was aborted before its range was computed): the chunk stays uncompiled."""


class PrefillClient(Protocol):
    """Sends one compile request to the running server and returns when it has answered."""

    def prefill(self, prompt: Sequence[int], save: SaveRequest) -> None: ...


class VllmPrefill:
    """Compile requests to vLLM's completions route: the prompt as token ids, ``max_tokens``
    1, the :class:`~kvnotes.serving.protocol.SaveRequest` in ``kv_transfer_params``. Blocking,
    on the learner's thread only; its answer is read for its status and dropped (no client
    ever sees it)."""

    def __init__(self, upstream: str, model: str, *, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.url = upstream.rstrip("/") + COMPLETIONS
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s

    def prefill(self, prompt: Sequence[int], save: SaveRequest) -> None:
        body = {"model": self.model, "prompt": [int(t) for t in prompt], "max_tokens": 1,
                "temperature": 0.0, "kv_transfer_params": save.to_params()}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                resp.read()
        # http.client.HTTPException too: a server that dies (or is restarted) while it
        # answers cuts the answer short (IncompleteRead, BadStatusLine), which is no OSError;
        # it is the same fault as a refused connection: no entry, the chunk stays uncompiled
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            raise SaveFailed(f"the compile request to {self.url} failed: {err}") from err


@dataclass(frozen=True, slots=True)
class EntryAddress:
    """How entries are addressed without an engine: the serving manifest's model and scheme,
    the library's anchor, and a tag for the producer's numerics (None where vLLM's entries are
    interchangeable with the engine's: a float32 server; else e.g. ``"vllm-bfloat16"``,
    hashed into the key so the two never stand for each other)."""

    fingerprint_id: str
    scheme: str
    bos_id: int | None
    producer_tag: str | None = None

    @classmethod
    def of(cls, manifest: ServingManifest, kv_dtype: str = "float32") -> EntryAddress:
        tag = None if kv_dtype == "float32" else f"vllm-{kv_dtype}"
        return cls(manifest.fingerprint_obj.id, manifest.scheme, manifest.bos_id, tag)

    @property
    def anchor(self) -> str:
        return "bos" if self.bos_id is not None else "none"

    def lead(self, after: Sequence[int]) -> list[int]:
        """The ids a chunk is prefilled behind: ``after``, or the anchor alone."""
        if after:
            return [int(t) for t in after]
        return [self.bos_id] if self.bos_id is not None else []

    def key(self, token_ids: Sequence[int], after: Sequence[int], tenant: str | None) -> str:
        """The entry's key: the library's content address (``ops.store.skill_key``)."""
        from kvnotes.ops.store import skill_key

        return self._tagged(skill_key(self.fingerprint_id, self.scheme, self.anchor,
                                      [int(t) for t in token_ids], None, after=list(after),
                                      tenant=tenant))

    def start_key(self, bos: int) -> str:
        """The key of the BOS alone at position 0 (the entry a BOS-led prompt starts with)."""
        from kvnotes.ops.store import skill_key

        return self._tagged(skill_key(self.fingerprint_id, self.scheme, "start", [bos]))

    def _tagged(self, key: str) -> str:
        if self.producer_tag is None:
            return key
        return hashlib.sha256(f"{key}|{self.producer_tag}".encode()).hexdigest()[:32]


def save_by_server(folder: Path, client: PrefillClient, key: str, lead: Sequence[int],
                   ids: Sequence[int], name: str, tenant: str | None) -> Path:
    """The file of entry ``key`` in ``folder``: ``ids`` prefilled by the server behind
    ``lead`` and saved by its connector, unless it is there already; :class:`SaveFailed` when
    the server saved none."""
    path = Path(folder) / f"{key}{ENTRY_SUFFIX}"
    if not path.is_file():
        client.prefill([*lead, *ids], SaveRequest(key, len(lead), len(lead) + len(ids), name,
                                                  tenant))
        if not path.is_file():
            raise SaveFailed(f"the server answered the compile of {name} but saved no "
                             f"entry {key} (see its log)")
    return path
