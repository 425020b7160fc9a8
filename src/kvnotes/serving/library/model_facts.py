"""What serving needs to know about a model, read from its folder without loading its weights.

``kvnotes serve`` leaves the model's one copy to vLLM: the front needs the tokenizer, the
config, the position adapter (the RoPE tables the connector rotates with), the model's
fingerprint (the skill library's namespace), the BOS id, the vocabulary size and the cache's
key shape. :class:`ModelFacts` reads them from the folder: the adapter is built over a
skeleton of the model made from its config with every parameter on the meta device (buffers,
the rotary tables among them, are real), and the fingerprint is
:meth:`~kvnotes.core.fingerprint.ModelFingerprint.of` that skeleton once the few weight
elements the fingerprint samples are read from the safetensors files: the same function
over the same values, so the id equals the loaded engine's.

Unlike the rest of :mod:`kvnotes.serving.library`, this module imports transformers' model
classes: the connector never imports it, and ``kvnotes serve``'s front reads the facts in a
child process (``ServingSkills(root, MODEL)``) so that they stay out of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvnotes.core.document import added_bos
from kvnotes.core.errors import NotebookFileError, UnknownModelError
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.core.positions import adapter_for
from kvnotes.core.positions.base import PositionAdapter
from kvnotes.serving.library.weights import leading_values, weight_files

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine

SAMPLED_TENSORS = 64  # what ModelFingerprint.of samples: the first 64 state-dict entries ...
SAMPLED_ELEMENTS = 256  # ... and the first 256 elements of each


@dataclass(frozen=True, eq=False)
class ModelFacts:
    """One model as a server's front sees it (see the module docstring).

    ``folder``: the safetensors folder whose digests the manifest records (None: a model
    built in memory, which a server refuses). ``num_kv_heads``/``head_dim``: the KV cache's
    key shape per layer.
    """

    name: str
    folder: Path | None
    tokenizer: Any
    adapter: PositionAdapter
    fingerprint: ModelFingerprint
    bos_id: int | None
    vocab_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def read(cls, model: str, *, dtype: torch.dtype = torch.float32) -> ModelFacts:
        """The facts of a bundled alias, ``.gguf`` file or HF folder (``kvnotes.load``'s
        names; a GGUF is converted once, as the engine's load does), as ``kvnotes.load(model,
        dtype=dtype)`` would see it, without loading its weights."""
        from kvnotes.core.models import resolve

        folder = resolve(model)
        if not isinstance(folder, Path) or not weight_files(folder):
            raise UnknownModelError(f"{model!r}: serving reads the model from a local folder "
                                    "of .safetensors files (download a hub model first)")
        return cls.of_folder(folder, name=model, dtype=dtype)

    @classmethod
    def of_folder(cls, folder: Path, *, name: str, dtype: torch.dtype = torch.float32
                  ) -> ModelFacts:
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        config = AutoConfig.from_pretrained(folder)
        with init_empty_weights(include_buffers=False):  # parameters on meta, buffers real
            skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
        skeleton.tie_weights()
        _sample_weights(skeleton, folder, dtype)
        adapter = adapter_for(skeleton)
        cfg = adapter.config
        heads = int(cfg.num_attention_heads)
        return cls(
            name=name, folder=folder, tokenizer=tokenizer, adapter=adapter,
            fingerprint=ModelFingerprint.of(skeleton, tokenizer), bos_id=added_bos(tokenizer),
            vocab_size=int(getattr(cfg, "vocab_size", 0) or len(tokenizer)),
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            dtype=dtype)

    @classmethod
    def of_engine(cls, engine: Engine, folder: Path | None) -> ModelFacts:
        """The facts of a loaded engine (its key shape from a one-token prefill)."""
        adapter = engine.adapter
        k = engine.prefill(engine.encode(".")[:1], bos=False).keys(0)  # [1, heads, 1, dim]
        return cls(
            name=engine.name, folder=folder, tokenizer=engine.tokenizer, adapter=adapter,
            fingerprint=engine.fingerprint, bos_id=engine.bos_id,
            vocab_size=int(getattr(adapter.config, "vocab_size", 0) or len(engine.tokenizer)),
            num_kv_heads=int(k.shape[1]), head_dim=int(k.shape[-1]), dtype=engine.dtype)


def _sample_weights(skeleton: torch.nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """Give the state-dict entries the fingerprint samples their leading elements, read from
    ``folder`` and cast to ``dtype`` as loading would (a tied entry: its source tensor's)."""
    state = skeleton.state_dict(keep_vars=True)
    names = sorted(state)[:SAMPLED_TENSORS]
    peers: dict[int, list[str]] = {}
    for name, tensor in state.items():
        peers.setdefault(id(tensor), []).append(name)
    wanted = sorted({n for name in names for n in peers[id(state[name])]})
    stored = leading_values(folder, wanted, SAMPLED_ELEMENTS)
    for name in names:
        if not state[name].is_meta:
            continue  # a buffer the config builds (the same on load)
        source = next((n for n in peers[id(state[name])] if n in stored), None)
        if source is None:
            raise NotebookFileError(f"{folder}: no tensor {name} in its .safetensors files")
        owner, _, attr = name.rpartition(".")
        module = skeleton.get_submodule(owner)
        sample = torch.nn.Parameter(stored[source].to(dtype), requires_grad=False)
        if attr in module._parameters:
            module._parameters[attr] = sample
        else:
            module._buffers[attr] = sample.data
