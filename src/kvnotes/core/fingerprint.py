"""A model fingerprint: enough to tell whether cached notes came from this exact model."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# config keys that change between saves of the same model and say nothing about its maths
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype",
                         "_commit_hash", "architectures", "quantization_config", "use_cache",
                         "_attn_implementation_autoset", "output_attentions", "return_dict"}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Vocabulary(Protocol):
    """What a fingerprint reads of a tokenizer (any transformers tokenizer has it)."""

    def get_vocab(self) -> dict[str, int]: ...


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Identity of the model that wrote a notebook: architecture, config, tokenizer, weights, dtype."""

    architecture: str
    model_type: str
    config_sha: str
    tokenizer_sha: str
    weights_sha: str
    dtype: str
    num_layers: int

    @property
    def id(self) -> str:
        """One short hash over every field (used as a namespace in the skill library)."""
        return _sha(json.dumps(asdict(self), sort_keys=True).encode())[:24]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> ModelFingerprint:
        """The fingerprint a header recorded; ``ValueError`` naming the field for a malformed one
        (headers come from files, so nothing is trusted)."""
        if not isinstance(data, dict):
            raise ValueError(f"a fingerprint is a JSON object, got {type(data).__name__}")
        names = [f for f in cls.__dataclass_fields__]
        if sorted(data) != sorted(names):
            raise ValueError(f"fingerprint fields {sorted(data)} are not {sorted(names)}")
        for name in names:
            value = data[name]
            if name == "num_layers":
                if type(value) is not int or value < 0:
                    raise ValueError(f"fingerprint field {name} must be an int >= 0, got {value!r}")
            elif type(value) is not str:
                raise ValueError(f"fingerprint field {name} must be a string, got {value!r}")
        return cls(**cast("dict[str, Any]", data))  # every field checked just above

    def differences(self, other: ModelFingerprint) -> list[str]:
        """Names of the fields that differ (for error messages)."""
        return [k for k, v in self.to_dict().items() if other.to_dict()[k] != v]

    @classmethod
    def of(cls, model: torch.nn.Module, tokenizer: Vocabulary) -> ModelFingerprint:
        config = cast("PretrainedConfig", model.config)
        cfg = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
        config_sha = _sha(json.dumps(cfg, sort_keys=True, default=str).encode())[:16]
        vocab = sorted(tokenizer.get_vocab().items())
        special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
        tokenizer_sha = _sha(json.dumps([vocab, special]).encode())[:16]
        # A sample of the weights tells two checkpoints of one config apart (random seeds,
        # fine-tunes) without hashing hundreds of MB.
        h = hashlib.sha256()
        for name, param in sorted(model.state_dict().items())[:64]:
            h.update(name.encode())
            h.update(param.detach().flatten()[:256].to(torch.float32).cpu().numpy().tobytes())
        text_config = config.get_text_config(decoder=True)
        return cls(
            architecture=type(model).__name__,
            model_type=str(getattr(config, "model_type", "")),
            config_sha=config_sha,
            tokenizer_sha=tokenizer_sha,
            weights_sha=h.hexdigest()[:16],
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
            num_layers=int(text_config.num_hidden_layers),
        )
