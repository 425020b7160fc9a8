"""kvnotes' vLLM KV connector: registered skills spliced into salted requests, prefix caching on.

Loaded by vLLM out of tree (``kvnotes serve`` passes these flags)::

    --kv-transfer-config '{"kv_connector": "KvnotesConnector",
                           "kv_connector_module_path": "kvnotes.serving.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"skills": "ROOT/<fingerprint>"}}'

Scheduler side: for a request whose ``cache_salt`` starts with ``kvnotes-splice``, match the
prompt from token 0 against the registered pieces (:func:`~kvnotes.serving.splice.leading_run`)
and report the part of that run beyond vLLM's local prefix hit as external tokens (vLLM takes
one contiguous external run per request, right after its local hit, and leaves at least one
token to compute). Worker side: before the forward, write each placed piece's keys (re-rotated
from the position it was compiled at to its place in the prompt) and values into the paged
cache through the attention backend's own ``do_kv_cache_update``, so the cache layout is the
backend's business. A piece that cannot be read marks its blocks failed, and vLLM recomputes
them. Requests without the salt are untouched. This module is the only one that imports vLLM.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvnotes.serving.piece_store import PieceStore, is_splice_salt
from kvnotes.serving.splice import (
    Placement,
    assemble_layer,
    external_tokens,
    leading_run,
    slot_mapping,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvnotes")  # a child of vLLM's logger: its handler prints these
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Tokens ``[start, end)`` of one request, supplied by ``run``, written at ``slots``."""

    req_id: str
    run: tuple[Placement, ...]
    start: int
    end: int
    slots: torch.Tensor  # LongTensor[end - start]
    block_ids: tuple[int, ...]


@dataclass
class KvnotesConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


def layer_index(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


class KvnotesConnector(KVConnectorBase_V1):
    """Splices kvnotes serving skills into requests salted ``kvnotes-splice*``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        folder = extra.get("skills")
        if not folder:
            raise ValueError("KvnotesConnector needs kv_connector_extra_config.skills: the "
                             "serving folder ROOT/<fingerprint> (`kvnotes serve` sets it)")
        scheduler = role == KVConnectorRole.SCHEDULER
        self.store = PieceStore(folder, max_bytes=int(float(extra.get("max_gib", 2)) * (1 << 30)),
                                keep_tensors=not scheduler)
        self._check_model(vllm_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.dtype: torch.dtype = vllm_config.model_config.dtype
        self._plans: dict[str, tuple[tuple[Placement, ...], int]] = {}
        self._pending: dict[str, tuple[tuple[Placement, ...], int, int]] = {}
        self._failed_blocks: set[int] = set()
        log.info("kvnotes connector (%s): %d skills in %s, block size %d",
                 "scheduler" if scheduler else "worker", len(self.store.index), folder,
                 self.block_size)

    def _check_model(self, vllm_config: VllmConfig) -> None:
        """Refuse, at server start, a served model the skills were not compiled for."""
        m = self.store.manifest
        hf = vllm_config.model_config.hf_text_config
        heads = int(getattr(hf, "num_attention_heads", 0) or 0)
        served = (int(hf.num_hidden_layers),
                  int(getattr(hf, "num_key_value_heads", heads) or heads),
                  int(getattr(hf, "head_dim", 0) or hf.hidden_size // max(1, heads)))
        want = (m.num_layers, m.num_kv_heads, m.head_dim)
        if served != want:
            raise ValueError(f"kvnotes skills in {self.store.folder} were compiled for {m.model} "
                             f"(layers, kv heads, head dim = {want}); the server runs a model "
                             f"with {served}. Point --skills at this model's skills.")
        if m.scheme != "rope":
            raise ValueError(f"kvnotes connector: position scheme {m.scheme!r} cannot be moved "
                             "exactly inside vLLM; serve without --skills")

    # ---- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not is_splice_salt(getattr(request, "cache_salt", None)):
            return 0, False
        self.store.refresh()
        tokens = list(request.prompt_token_ids or [])
        run = leading_run(tokens, self.store.index)
        ext = external_tokens(run, len(tokens), num_computed_tokens)
        if ext:
            self._plans[request.request_id] = (tuple(run), num_computed_tokens + ext)
        else:
            self._plans.pop(request.request_id, None)
        return ext, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        plan = self._plans.pop(request.request_id, None)
        if num_external_tokens <= 0 or plan is None:
            return
        run, end = plan
        # the external run always ends where the matched run (capped) ends
        self._pending[request.request_id] = (run, end - num_external_tokens, end)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvnotesConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            pending = self._pending.pop(new_req.req_id, None)
            if pending is None:
                continue
            run, start, end = pending
            block_ids = tuple(new_req.block_ids[0])
            meta.loads.append(LoadSpec(new_req.req_id, run, start, end,
                                       slot_mapping(block_ids, self.block_size, start, end),
                                       block_ids))
        # requests that were planned but not scheduled this step are planned again next time
        self._pending.clear()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._plans.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        return False, None

    # ---- worker side -------------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvnotesConnectorMetadata) or not meta.loads:
            return
        layers = [(i, layer) for name, layer in forward_context.no_compile_layers.items()
                  if (i := layer_index(name)) is not None
                  and getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl")]
        for load in meta.loads:
            t0 = time.perf_counter()
            try:
                for p in load.run:  # read every piece first: a missing one fails the load whole
                    self.store.load(p.piece.key)
            except Exception as err:  # noqa: BLE001 -- a bad entry must never kill the server
                log.warning("kvnotes: request %s: skill unavailable (%s); recomputing",
                            load.req_id, err)
                self._failed_blocks.update(
                    load.block_ids[load.start // self.block_size:-(-load.end // self.block_size)])
                continue
            for i, layer in layers:
                keys, values = assemble_layer(load.run, load.start, load.end, i,
                                              self.store.inv_freqs[i], self.store.load,
                                              self.dtype)
                layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache,
                                              load.slots.to(layer.kv_cache.device))
            log.info("kvnotes: request %s: spliced tokens [%d, %d) from %d pieces in %.1f ms",
                     load.req_id, load.start, load.end, len(load.run),
                     1000 * (time.perf_counter() - t0))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # skills are compiled by kvnotes, not captured from the server

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
