"""kvnotes' vLLM KV connector: registered skills spliced into salted requests, prefix caching on.

Loaded by vLLM out of tree (``kvnotes serve`` passes these flags)::

    --kv-transfer-config '{"kv_connector": "KvnotesConnector",
                           "kv_connector_module_path": "kvnotes.serving.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"skills": "ROOT/<fingerprint>"}}'

Which requests: those that carry a splice request (a
:class:`~kvnotes.serving.protocol.SpliceRequest` in their ``kv_transfer_params``) and the
``cache_salt`` its tenant and repair tag give (``kvnotes-splice[:<tenant>][+<tag>]``,
composed and compared, never parsed). The salt keeps their prefix-cache entries apart from
exact requests' (spliced KV is close to, not equal to, a prefill), a tenant's apart from other
tenants' and one repair plan's (the tag) apart from another's; the worker's tensor cache is
namespaced by tenant. Every other request is served exactly as without kvnotes.

Scheduler side (:mod:`kvnotes.serving.vllm.plans`): a request that names splice ranges (sent
by :mod:`kvnotes.serving.planning.phases`' plans) is supplied only inside those ranges, from
vLLM's local prefix hit on; one whose message cannot be read (another version, an unknown
field, a malformed range) or whose salt is not its tenant's and tag's is supplied nothing,
logged with why; one without ranges (:meth:`~kvnotes.serving.protocol.SpliceRequest.leading`,
``ComposeClient``'s) gets the prompt's leading run of registered pieces past the local hit. Either way the
external tokens are one contiguous run right after the local hit (all vLLM takes), leaving at
least one token to compute. The load is recorded with the request's blocks when vLLM
allocates them and handed to the workers in the step that schedules the request: a new one,
or one resumed after preemption (which the V1 model runner lists among its cached requests).
When a spliced request finishes, ``request_finished`` returns what was done for it (a
:class:`~kvnotes.serving.protocol.SpliceReport`: ranges loaded, entries used, tokens supplied
and computed, loads that failed, learned from vLLM's ``invalid_block_ids``); vLLM puts it in
the completion's ``kv_transfer_params``.

Worker side (:mod:`kvnotes.serving.vllm.kv_writer`): before the forward, build each load's keys (re-
rotated from where each piece was compiled to its place in the prompt) and values on the cache's
device, for this rank's KV heads and this stage's layers, and write them through the attention
backend's own ``do_kv_cache_update`` (the cache layout, fp8 scales included, stays the
backend's). A piece deleted, damaged or replaced since it was planned fails its load: its blocks
go to ``get_block_ids_with_load_errors`` and vLLM recomputes them (policy ``"recompute"``; with
vLLM's default ``"fail"`` the request fails instead, so the connector warns at start).

Compiling (:mod:`kvnotes.serving.vllm.saves`, :mod:`kvnotes.serving.vllm.kv_saver`): a
request carrying a :class:`~kvnotes.serving.protocol.SaveRequest` (under ``kvnotes_save``) is
an ordinary prefill that is supplied nothing; its blocks are followed until the step whose
forward computes its range, and after that forward (``wait_for_save``, once every layer's
attention ran: ``save_kv_layer``) the worker reads the range's KV from the blocks, prefix-cache
hits included, and writes it as an entry of the folder, whole or not at all. A request that ends
before that step saves nothing; a save that cannot be written is logged and counted, no file.

Refused at server start, each with the setting to change (:mod:`kvnotes.serving.vllm.checks`):
a model other than the skills' (shape, or RoPE tables differing from vLLM's rotary embedding),
speculative decoding with draft layers, LoRA, MLA, decode/prefill context parallelism,
KV-sharing layers, a backend without a separate cache write, a cache whose heads, head size,
dtype or device this rank cannot write. Tensor and pipeline parallelism are supported.

This module is the only one that imports vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvnotes.core.errors import InvalidArgumentError, ServingError
from kvnotes.serving.json_types import JsonObject
from kvnotes.serving.library.manifest import ServingManifest, splice_salt
from kvnotes.serving.library.piece_store import DEFAULT_MAX_ENTRY_BYTES, PieceStore
from kvnotes.serving.protocol import ProtocolError, SpliceRequest
from kvnotes.serving.vllm.checks import (
    ServedModel,
    check_layers,
    check_rope,
    check_served,
    check_weights,
)
from kvnotes.serving.vllm.kv_saver import KvSaver
from kvnotes.serving.vllm.kv_writer import KvWriter, WorkerShare, rank_heads
from kvnotes.serving.vllm.plans import LoadSpec, SplicePlanner
from kvnotes.serving.vllm.saves import SaveSpec, SaveTracker, save_request

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvnotes")  # a child of vLLM's logger: its handler prints these


@dataclass
class KvnotesConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def splice_tenant(salt: str | None, message: SpliceRequest) -> tuple[str | None, str | None]:
    """``(tenant, refused)`` of a request that carries a splice request: the tenant and repair
    tag are the message's fields, and the request's salt must be the one they give (composed
    and compared, never parsed); another salt is refused (``refused`` says why: the request is
    served exactly and its report says so)."""
    try:
        expected = splice_salt(message.tenant, message.tag)
    except InvalidArgumentError as err:
        return None, f"its tenant or tag: {err}"
    if salt != expected:
        return None, (f"its cache_salt {salt!r} is not {expected!r}, the salt of its tenant "
                      "and tag")
    return message.tenant, None


def splice_request(request: Any) -> tuple[SpliceRequest | None, str | None]:
    """``(message, None)``: the request's splice request (None when its ``kv_transfer_params``
    carry none); ``(None, why)`` when it carries one this connector cannot read."""
    try:
        return SpliceRequest.from_params(getattr(request, "kv_transfer_params", None)), None
    except ProtocolError as err:
        return None, str(err)


def tensor_parallel() -> tuple[int, int]:
    """``(rank, size)`` of this worker in its tensor-parallel group."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def rotary_embeddings() -> list[Any]:
    """The rotary embedding modules this process's model built (vLLM caches each one)."""
    try:
        from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT
    except ImportError:
        return []
    return list(_ROPE_DICT.values())


def served_model(vllm_config: VllmConfig) -> ServedModel:
    hf = vllm_config.model_config.hf_text_config
    heads = int(getattr(hf, "num_attention_heads", 0) or 0)
    spec = vllm_config.speculative_config
    par = vllm_config.parallel_config
    return ServedModel(
        num_layers=int(hf.num_hidden_layers),
        num_kv_heads=int(getattr(hf, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(hf, "head_dim", 0) or hf.hidden_size // max(1, heads)),
        tensor_parallel=int(getattr(par, "tensor_parallel_size", 1)),
        decode_context_parallel=int(getattr(par, "decode_context_parallel_size", 1)),
        prefill_context_parallel=int(getattr(par, "prefill_context_parallel_size", 1)),
        speculative_method=(str(spec.method) if spec is not None and spec.uses_draft_kv_cache()
                            else None),
        lora=vllm_config.lora_config is not None,
        mla=bool(getattr(vllm_config.model_config, "use_mla", False)))


class KvnotesConnector(KVConnectorBase_V1):
    """Splices kvnotes serving skills into requests salted ``kvnotes-splice[:<tenant>][+<tag>]``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        folder = extra.get("skills")
        if not folder:
            raise ServingError("KvnotesConnector needs kv_connector_extra_config.skills: the "
                               "serving folder ROOT/<fingerprint> (`kvnotes serve` sets it)")
        self.folder = str(folder)
        self.max_bytes = int(float(extra.get("max_gib", 2)) * (1 << 30))
        self.max_entry_bytes = int(float(extra.get("max_entry_mib", DEFAULT_MAX_ENTRY_BYTES
                                                   >> 20)) * (1 << 20))
        self.manifest = ServingManifest.read(self.folder)
        served = served_model(vllm_config)
        check_served(self.manifest, served, self.folder)
        check_weights(self.manifest, vllm_config.model_config.model, self.folder)
        try:
            rank_heads(served.num_kv_heads, served.tensor_parallel, 0)
        except InvalidArgumentError as err:
            raise ServingError(f"kvnotes connector: {err}; choose another "
                               "--tensor-parallel-size") from err
        self.block_size = int(vllm_config.cache_config.block_size)
        self.dtype: torch.dtype = vllm_config.model_config.dtype
        self.scheduler = role == KVConnectorRole.SCHEDULER
        self.store: PieceStore | None = None
        self.planner: SplicePlanner | None = None
        self.writer: KvWriter | None = None
        self.saver: KvSaver | None = None
        self.saves: SaveTracker | None = None
        self._layers: list[tuple[int, str]] = []
        self._failed_blocks: set[int] = set()
        self._forwarded: set[str] = set()  # layers whose attention ran in this step
        if self.scheduler:
            self.store = PieceStore(self.folder, max_entry_bytes=self.max_entry_bytes)
            self.planner = SplicePlanner(block_size=self.block_size)
            self.saves = SaveTracker(block_size=self.block_size)
            policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")
            if policy != "recompute":
                log.warning("kvnotes connector: kv_load_failure_policy is %r: a skill deleted "
                            "or damaged while serving fails the requests using it; set "
                            "\"kv_load_failure_policy\": \"recompute\" (kvnotes serve does) to "
                            "recompute them instead", policy)
            log.info("kvnotes connector (scheduler): %d skills in %s, block size %d",
                     len(self.store.index), self.folder, self.block_size)

    # ---- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.planner is not None and self.store is not None
        if self._compile_request(request):
            return 0, False  # a compile is a prefill: nothing is supplied to it
        message, refused = splice_request(request)
        if (message is None and refused is None) or getattr(request, "mm_features", None):
            # no splice request: computed exactly, whatever its salt; multimodal prompts:
            # placeholders are not text the skills hold
            return 0, False
        tenant = None
        if message is not None:
            tenant, refused = splice_tenant(getattr(request, "cache_salt", None), message)
        self.store.refresh()
        tokens = list(request.prompt_token_ids or [])
        # a tenant is matched against the shared pieces and its own, never another tenant's
        return self.planner.match(request.request_id, tenant, tokens, num_computed_tokens,
                                  self.store.view(tenant), message, refused), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.planner is not None
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else ()
        self.planner.allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.planner is not None
        # every request this step schedules, new, resumed or running, is a key here
        saves = [] if self.saves is None else self.saves.take(scheduler_output)
        return KvnotesConnectorMetadata(self.planner.take(scheduler_output.num_scheduled_tokens),
                                        saves)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.planner is not None:
            self.planner.failed(getattr(connector_output, "invalid_block_ids", None) or ())

    def _compile_request(self, request: Request) -> bool:
        """True for a compile request (a save request in its ``kv_transfer_params``): it is
        followed until its range is computed. One that cannot be read is served as it is and
        saves nothing."""
        assert self.saves is not None
        message, refused = save_request(request)
        if refused is not None:
            log.warning("kvnotes: request %s: its save request was refused (%s); nothing is "
                        "saved", request.request_id, refused)
            return True
        if message is None:
            return False
        self.saves.track(request.request_id, message, list(request.prompt_token_ids or []))
        return True

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, JsonObject | None]:
        """Nothing is held past the request; its report goes back in ``kv_transfer_params``."""
        if self.saves is not None:
            self.saves.finished(request.request_id)
        report = None if self.planner is None else self.planner.finished(request.request_id)
        return False, None if report is None else report.to_params()

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Check, once the caches exist, that this worker can write them; refuse otherwise."""
        rank, size = tensor_parallel()
        heads = rank_heads(self.manifest.num_kv_heads, size, rank)
        layers = self._vllm_config.compilation_config.static_forward_context
        self._layers = check_layers(self.manifest, layers, kv_caches, heads=heads,
                                    dtype=self.dtype)
        if not self._layers:
            log.warning("kvnotes connector (worker): no attention layer to write; nothing "
                        "will be spliced on this worker")
            return
        device = kv_caches[self._layers[0][1]].device
        compared = check_rope(self.manifest, rotary_embeddings())
        if not compared:
            log.warning("kvnotes connector (worker): vLLM's rotary embeddings were not found; "
                        "the skills' RoPE tables are used unchecked")
        share = WorkerShare(device=device, dtype=self.dtype, heads=heads,
                            layers=tuple(i for i, _ in self._layers))
        self.writer = KvWriter(self.folder, self.manifest, share, max_bytes=self.max_bytes,
                               max_entry_bytes=self.max_entry_bytes)
        self.saver = KvSaver(self.folder, self.manifest, heads=heads,
                             head_dim=self.manifest.head_dim, block_size=self.block_size,
                             dtype=kv_caches[self._layers[0][1]].dtype)
        log.info("kvnotes connector (worker, tp rank %d of %d): layers %d..%d, KV heads %d..%d "
                 "on %s in %s; RoPE tables checked against %d rotary embeddings", rank, size,
                 share.layers[0], share.layers[-1], heads.start, heads.stop - 1, device,
                 self.dtype, compared)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvnotesConnectorMetadata) or not meta.loads:
            return
        if self.writer is None:  # no layer here, or the caches were never registered
            if self._layers:
                raise AssertionError("kvnotes connector: loads before register_kv_caches")
            return
        ctx = forward_context.no_compile_layers
        self._failed_blocks |= self.writer.write(meta.loads,
                                                 [(i, ctx[name]) for i, name in self._layers])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # called after each layer's attention: a save needs every layer's to have run
        self._forwarded.add(layer_name)

    def wait_for_save(self) -> None:
        """After the forward: save the compile requests whose range it completed, from their
        blocks; none when the forward did not reach every layer (it failed mid-way)."""
        forwarded, self._forwarded = self._forwarded, set()
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvnotesConnectorMetadata) or not meta.saves:
            return
        if self.saver is None:
            log.warning("kvnotes: %d compile requests not saved: this worker holds no "
                        "attention layer", len(meta.saves))
            return
        missing = [name for _, name in self._layers if name not in forwarded]
        if missing:
            self.saver.failed += len(meta.saves)
            log.warning("kvnotes: compile requests %s not saved: the forward did not run "
                        "layer %s", [s.req_id for s in meta.saves], missing[0])
            return
        ctx = self._vllm_config.compilation_config.static_forward_context
        self.saver.save(meta.saves, [(i, ctx[name]) for i, name in self._layers])

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
