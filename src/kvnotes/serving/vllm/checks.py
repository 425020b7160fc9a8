"""What the vLLM connector refuses at server start, and why: each check names the setting.

A splice writes keys and values into vLLM's paged cache that vLLM did not compute; if they do
not fit the model and layout being served, the server answers wrongly and says nothing. So the
connector checks, before the first request:

- :func:`check_served` (both processes, from the configuration): the model's shape against the
  manifest's; and it refuses what the connector cannot write correctly yet: speculative decoding
  with draft layers (their KV for spliced tokens would be missing), LoRA (an adapter on the
  key/value projections makes other KV than the base model's skills hold), MLA (a latent cache,
  another write), decode/prefill context parallel (slots interleaved across ranks);
- :func:`check_weights` (both processes, from the model path vLLM serves): the served weights
  are the ones the skills were compiled with (digests of sampled elements,
  :mod:`kvnotes.serving.library.weights`): a fine-tune of the same shape passes every other check;
- :func:`check_layers` (each worker, with its cache tensors): every attention layer maps to a
  manifest layer, is not a KV-sharing layer, has the backend's ``(layer, key, value, kv_cache,
  slot_mapping)`` write, and holds exactly the KV heads and head size this rank writes;
- :func:`check_rope` (each worker, with vLLM's rotary embeddings): the manifest's RoPE tables
  are the ones the served model rotates with (a changed ``rope_theta`` or scaling of the same
  shape passes a shape check).

Nothing here imports vLLM: the connector passes plain values and the layer objects.
"""

from __future__ import annotations

import inspect
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvnotes.core.errors import KvnotesError, ServingError
from kvnotes.serving.library.manifest import ServingManifest
from kvnotes.serving.library.weights import WeightsDigest, served_digest

_LAYER = re.compile(r"layers\.(\d+)\.")
WRITE_PARAMS = ("layer", "key", "value", "kv_cache", "slot_mapping")
_FIX = "Serve without --skills (kvnotes' connector off), or"


def layer_index(name: str) -> int | None:
    """The decoder layer index in a vLLM layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the connector reads from vLLM's configuration (both processes)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_parallel: int = 1
    decode_context_parallel: int = 1
    prefill_context_parallel: int = 1
    speculative_method: str | None = None  # set only for methods with draft-model KV
    lora: bool = False
    mla: bool = False


def check_served(manifest: ServingManifest, served: ServedModel, folder: object) -> None:
    """Refuse, with a message that names the fix, a server the skills cannot be spliced into."""
    want = (manifest.num_layers, manifest.num_kv_heads, manifest.head_dim)
    got = (served.num_layers, served.num_kv_heads, served.head_dim)
    if got != want:
        raise ServingError(f"kvnotes skills in {folder} were compiled for {manifest.model} "
                           f"(layers, kv heads, head dim = {want}); the server runs a model with "
                           f"{got}. Point --skills at this model's skills.")
    if manifest.scheme != "rope":
        raise ServingError(f"kvnotes connector: position scheme {manifest.scheme!r} cannot be "
                           "moved exactly inside vLLM; serve without --skills")
    check_features(served)


def check_features(served: ServedModel) -> None:
    """Refuse the features the connector cannot write correctly (MLA, draft speculation, LoRA,
    context parallelism), with the setting to change."""
    if served.mla:
        raise ServingError("kvnotes connector: the model uses MLA (a latent KV cache "
                           f"with its own write); the connector writes keys and values. {_FIX} "
                           "serve a model with standard attention.")
    if served.speculative_method:
        raise ServingError(
            f"kvnotes connector: speculative decoding {served.speculative_method!r} runs draft "
            "layers with their own KV cache, which spliced skills do not fill. "
            f"{_FIX} drop --speculative-config (n-gram speculation, which has no draft KV, is "
            "allowed).")
    if served.lora:
        raise ServingError(
            "kvnotes connector: LoRA is enabled; an adapter on the key/value projections makes "
            f"other KV than the base model's compiled skills hold. {_FIX} serve the adapters "
            "from a second server started without --skills.")
    if served.decode_context_parallel > 1 or served.prefill_context_parallel > 1:
        raise ServingError(
            "kvnotes connector: context parallelism (decode "
            f"{served.decode_context_parallel}, prefill {served.prefill_context_parallel}) "
            f"interleaves a request's slots across ranks. {_FIX} set "
            "--decode-context-parallel-size 1 and --prefill-context-parallel-size 1.")


# vLLM flags the launcher sets itself (each from its own option of `kvnotes serve`)
LAUNCHER_FLAGS = {
    "--model": "MODEL argument", "--served-model-name": "MODEL argument", "--host": "--host option",
    "--port": "--port option", "--kv-transfer-config": "--skills option",
    "--dtype": "--dtype option", "--max-model-len": "--max-model-len option",
    "--block-size": "block_size setting (--config FILE)",
    "--no-enable-prefix-caching": "(prefix caching must stay on)",
}
_NO_DRAFT_KV = ("ngram", "suffix")  # speculation methods without draft-model KV


def check_vllm_args(args: Iterable[str]) -> None:
    """Refuse, before anything starts, vLLM command-line flags a connector server cannot run
    with (those :func:`check_features` refuses at start, and those the launcher sets itself);
    every other flag is passed to vLLM unchanged.

    Example:
        >>> check_vllm_args(["--tensor-parallel-size", "2", "--gpu-memory-utilization=0.8"])
        >>> try:
        ...     check_vllm_args(["--enable-lora"])
        ... except ServingError as err:
        ...     print(str(err)[:35])
        kvnotes connector: LoRA is enabled;
    """
    args = list(args)
    values: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("-"):
            continue
        name, eq, value = arg.partition("=")
        name = name.replace("_", "-")
        nxt = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        values[name] = value if eq else nxt
        if name in LAUNCHER_FLAGS:
            raise ServingError(f"vLLM flag {name} is set by `kvnotes serve` itself: use its "
                               f"{LAUNCHER_FLAGS[name]} instead of passing it after --")
    speculative = values.get("--speculative-config")
    method = None
    if speculative is not None:
        try:
            import json

            method = str(json.loads(speculative).get("method") or "draft_model")
        except (ValueError, AttributeError):
            method = "draft_model"
        method = None if method in _NO_DRAFT_KV else method

    def size(*names: str) -> int:
        for n in names:
            if values.get(n) is not None:
                try:
                    return int(str(values[n]))
                except ValueError:
                    return 1
        return 1

    check_features(ServedModel(
        num_layers=0, num_kv_heads=0, head_dim=0, speculative_method=method,
        lora="--enable-lora" in values or "--lora-modules" in values,
        decode_context_parallel=size("--decode-context-parallel-size", "-dcp"),
        prefill_context_parallel=size("--prefill-context-parallel-size", "-pcp")))


def check_weights(manifest: ServingManifest, model: str | os.PathLike[str], folder: object
                  ) -> str:
    """Refuse unless the weights vLLM serves from ``model`` (``vllm_config.model_config.model``)
    are the ones the skills in ``folder`` were compiled with; returns the digest compared.

    The served folder's float dtype picks which of the manifest's digests must match, so a
    float32 or bfloat16 copy of the compiled weights passes and a fine-tune does not.
    """
    if manifest.weights is None:
        raise ServingError(
            f"kvnotes skills in {folder}: serving.json records no digest of the weights they "
            f"were compiled with, so the server cannot tell {manifest.model} from a fine-tune "
            "of the same shape. Re-export the skills with this kvnotes (`kvnotes skills add "
            "--model M --skills DIR ...` or `kvnotes serve` rewrites the manifest).")
    try:
        want = WeightsDigest.from_dict(manifest.weights)
    except TypeError as err:
        raise ServingError(f"kvnotes skills in {folder}: serving.json's weights digest is "
                           f"malformed ({err}); re-export the skills") from err
    path = os.fspath(model)
    if not os.path.isdir(path):
        raise ServingError(
            f"kvnotes connector: the served model {path!r} is not a local folder of "
            ".safetensors weights, so its weights cannot be compared with the skills'. "
            f"{_FIX} serve the folder `kvnotes serve` exports.")
    try:
        dtype, got = served_digest(path)
    except KvnotesError as err:
        raise ServingError(f"kvnotes connector: cannot fingerprint the served weights: {err}. "
                           f"{_FIX} serve the folder `kvnotes serve` exports.") from err
    if dtype not in want.sha256:
        raise ServingError(f"kvnotes connector: the served weights in {path} are {dtype}; the "
                           f"skills' manifest has digests for {sorted(want.sha256)}. Serve one "
                           "of those dtypes (--dtype).")
    if got != want.sha256[dtype]:
        raise ServingError(
            f"kvnotes skills in {folder} were compiled with other weights than the ones served "
            f"from {path} (same shape, different values: a fine-tune or another checkpoint of "
            f"{manifest.model}; {dtype} digest {got[:12]} is not {want.sha256[dtype][:12]}). "
            "Compile the skills with the served model (kvnotes skills add --model <it>), or "
            "serve the model they were compiled with.")
    return got


def check_layers(manifest: ServingManifest, layers: Mapping[str, object],
                 kv_caches: Mapping[str, torch.Tensor], *, heads: range, dtype: torch.dtype,
                 ) -> list[tuple[int, str]]:
    """``(manifest layer, layer name)`` of each attention layer this worker writes, sorted;
    :class:`ServingError` for any layer the connector cannot write exactly.

    ``layers``: vLLM's static forward context (name -> attention layer); ``kv_caches``: the
    tensors ``register_kv_caches`` received; ``heads``: the KV heads this rank holds; ``dtype``:
    what the forward hands the cache write (the model dtype).
    """
    out: list[tuple[int, str]] = []
    devices: set[torch.device] = set()
    for name, layer in layers.items():
        if not hasattr(layer, "impl") or name not in kv_caches:
            continue  # not an attention layer with a paged cache (e.g. an encoder's)
        i = layer_index(name)
        if i is None:
            raise ServingError(f"kvnotes connector: attention layer {name!r} has no "
                               "'layers.<i>.' index to map to the skills' layers. "
                               f"{_FIX} serve a decoder whose layers are named that way.")
        if i >= manifest.num_layers:
            raise ServingError(
                f"kvnotes connector: attention layer {name!r} is beyond the "
                f"{manifest.num_layers} layers of {manifest.model} (a speculative-decoding "
                f"draft layer?): spliced skills have no KV for it. {_FIX} drop "
                "--speculative-config.")
        shared = getattr(layer, "kv_sharing_target_layer_name", None)
        if shared:
            raise ServingError(
                f"kvnotes connector: layer {name!r} shares the KV cache of "
                f"{shared!r} (cross-layer KV sharing), which the "
                f"connector does not write yet. {_FIX} serve a model without KV sharing.")
        backend = getattr(layer, "attn_backend", None)
        if backend is not None and getattr(backend, "forward_includes_kv_cache_update", False):
            raise ServingError(
                f"kvnotes connector: the attention backend of {name!r} "
                f"({getattr(backend, '__name__', type(backend).__name__)}) writes the "
                f"cache inside its forward, with no separate write to splice through. {_FIX} "
                "choose another backend (VLLM_ATTENTION_BACKEND).")
        _check_write(name, layer)
        cache = kv_caches[name]
        layer_heads = int(getattr(layer, "num_kv_heads", -1))
        head_size = int(getattr(layer, "head_size", -1))
        if layer_heads != len(heads) or head_size != manifest.head_dim:
            raise ServingError(
                f"kvnotes connector: layer {name!r} holds {layer_heads} KV heads of size "
                f"{head_size}; this rank should write {len(heads)} of the "
                f"{manifest.num_kv_heads} heads (heads {heads.start}..{heads.stop - 1}) of "
                f"size {manifest.head_dim}. The tensor-parallel split differs from vLLM's "
                "QKVParallelLinear: report this with the model and --tensor-parallel-size.")
        if len(heads) not in cache.shape:
            raise ServingError(f"kvnotes connector: the cache of {name!r} has shape "
                               f"{tuple(cache.shape)}, with no dimension of {len(heads)} KV "
                               "heads; an unknown cache layout.")
        kv_dtype = str(getattr(layer, "kv_cache_dtype", "auto"))
        if kv_dtype == "auto" and cache.dtype != dtype:
            raise ServingError(
                f"kvnotes connector: the cache of {name!r} is {cache.dtype} but the model "
                f"runs in {dtype} with kv_cache_dtype 'auto'; the connector hands the cache "
                "write tensors in the model dtype. Set --dtype and --kv-cache-dtype to agree.")
        if not dtype.is_floating_point:
            raise ServingError(f"kvnotes connector: model dtype {dtype} is not a float type")
        devices.add(cache.device)
        out.append((i, name))
    if len(devices) > 1:
        raise ServingError(f"kvnotes connector: one worker's caches are on several devices "
                           f"{sorted(map(str, devices))}; the connector stages each load to "
                           "one device.")
    return sorted(out)


def _check_write(name: str, layer: Any) -> None:
    write = getattr(layer.impl, "do_kv_cache_update", None)
    try:
        params = tuple(inspect.signature(write).parameters) if write is not None else ()
    except (TypeError, ValueError):
        params = ()
    if params[:len(WRITE_PARAMS)] != WRITE_PARAMS:
        kind = "MLA's latent" if "kv_c_normed" in params else "no standard"
        raise ServingError(
            f"kvnotes connector: the attention backend of {name!r} has {kind} cache write "
            f"({type(layer.impl).__name__}.do_kv_cache_update{params}); the connector writes "
            f"through do_kv_cache_update{WRITE_PARAMS}. {_FIX} choose a standard attention "
            "backend.")


# positions at which vLLM's cos/sin cache and the manifest's tables must agree
ROPE_PROBES = (1, 2, 3, 17, 100, 511, 2047)


def check_rope(manifest: ServingManifest, embeddings: Iterable[Any], *,
               atol: float = 2e-2) -> int:
    """Refuse unless each of the manifest's RoPE tables is one the served model rotates with.

    ``embeddings``: vLLM's rotary embedding modules (each with ``cos_sin_cache`` ``[positions,
    rotary_dim]``, cos then sin halves, and ``is_neox_style``). ``atol`` covers a bf16 cache;
    a changed ``rope_theta`` or scaling moves values by far more at these positions. Returns the
    number of embeddings compared (0: nothing to compare; the caller says it did not check).
    """
    tables = []
    for emb in embeddings:
        cache = getattr(emb, "cos_sin_cache", None)
        if not isinstance(cache, torch.Tensor) or cache.dim() != 2:
            continue
        tables.append((bool(getattr(emb, "is_neox_style", True)), cache))
    if not tables:
        return 0
    first_use = {tuple(f): l for l, f in reversed(list(enumerate(manifest.inv_freqs)))}
    for freqs, layer in sorted(first_use.items(), key=lambda kv: kv[1]):
        inv = torch.tensor(freqs, dtype=torch.float64)
        if not any(_same_table(inv, neox, cache, atol) for neox, cache in tables):
            base = _base_of(inv)
            raise ServingError(
                f"kvnotes connector: the skills' RoPE table for layer {layer} ({inv.numel()} "
                f"frequencies{base}) is none of the served model's rotary embeddings "
                "(rope_theta, rope scaling or partial rotary differ: another checkpoint or "
                "--hf-overrides?). Compile the skills with the model being served.")
    return len(tables)


def _same_table(inv: torch.Tensor, neox: bool, cache: torch.Tensor, atol: float) -> bool:
    half = inv.numel()
    if not neox or cache.shape[1] != 2 * half:
        return False
    probes = [p for p in ROPE_PROBES if p < cache.shape[0]]
    pos = torch.tensor(probes, dtype=torch.float64)
    angles = pos[:, None] * inv[None, :]
    want = torch.cat((angles.cos(), angles.sin()), dim=-1)
    got = cache[probes].detach().to("cpu", torch.float64)
    return bool(torch.allclose(got, want, atol=atol, rtol=0))


def _base_of(inv: torch.Tensor) -> str:
    if inv.numel() < 2 or inv[1] <= 0:
        return ""
    # plain RoPE: inv_freq[j] = base ** (-2j / rotary_dim)
    base = float(inv[1]) ** (-inv.numel())
    return f", base ~{base:.4g}" if math.isfinite(base) else ""
