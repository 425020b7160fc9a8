"""What a position adapter allows, operation by operation: exact, approximate or unsupported.

``kvnotes doctor`` prints this table, and the architecture-matrix tests check every "exact" in it
against a prefill at the target position.

Example:
    >>> from kvnotes.core.positions.capabilities import capabilities
    >>> [(op.name, op.status) for op in capabilities(engine.adapter)][:2]  # a RoPE model
    [('prefill / extend / decode', 'exact'), ('shift (move notes by d positions)', 'exact')]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from kvnotes.core.positions.base import PositionAdapter

STATUSES = ("exact", "approximate", "unsupported")


@dataclass(frozen=True, slots=True)
class Operation:
    """One notebook operation and how well this model's position scheme supports it."""

    name: str
    status: str  # one of STATUSES
    reason: str

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def shift_status(adapter: PositionAdapter) -> tuple[str, str]:
    """``(status, reason)`` for moving cached notes to other positions with this adapter."""
    if not adapter.supported:
        return "unsupported", adapter.approximate_reason or f"scheme {adapter.name!r} unsupported"
    if adapter.exact_shift:
        return "exact", _exact_reason(adapter)
    if adapter.approximate:
        return "approximate", (adapter.approximate_reason or "approximate re-rotation") + (
            "; pass allow_approximate=True to shifted()/moved_to()")
    return "unsupported", adapter.approximate_reason or "the scheme cannot move cached notes"


def _exact_reason(adapter: PositionAdapter) -> str:
    own = getattr(adapter, "shift_reason", None)  # a scheme may say it in its own words
    if own:
        return str(own)
    info = adapter.describe()
    dims = info.get("rotary_dims")
    where = "the value slot's rotary key (the latent never moves)" if info.get(
        "rotary_slot") == "values" else "keys"
    partial = ""
    cfg = adapter.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if isinstance(dims, list) and head_dim and max(dims) < head_dim:
        partial = f" (partial rotary: {max(dims)} of {head_dim} dims per head turn)"
    pairs = " with adjacent-dim pairs" if info.get("rotary_pairs") == "adjacent" else ""
    return f"R(p+d) = R(d)R(p): re-rotating {where}{pairs} by d is exact up to float error{partial}"


def capabilities(adapter: PositionAdapter) -> list[Operation]:
    """The operations kvnotes offers and their status for this adapter, with reasons."""
    shift, why = shift_status(adapter)
    ops = [
        Operation("prefill / extend / decode", "exact" if adapter.supported else "unsupported",
                  "the model's own forward over the notebook's cache"),
        Operation("shift (move notes by d positions)", shift, why),
        Operation("compose (splice a compiled skill at another offset)", shift,
                  why if shift != "exact" else "re-positioning is exact; the skill's notes were "
                  "written without the context before it (composition's own approximation, "
                  "measured by kvnotes.eval.fidelity)"),
        Operation("erratum edit (append after the notes)",
                  "exact" if adapter.supported else "unsupported",
                  "append-only: no cached token moves"),
        Operation("save / load", "exact", "tensors stored as written (safetensors)"),
        Operation("int8 storage (kvnotes.ops.quant)", "approximate",
                  "absmax int8 per token or channel: round trip within half a quantization "
                  "step per element; a shift dequantizes, rotates and quantizes again"),
    ]
    window = getattr(adapter, "sliding_window", None)
    if window and any("sliding" in t for t in getattr(adapter, "layer_types", ())):
        ops.append(Operation(
            "sliding-window layers", "exact",
            f"the notebook keeps every token; the model's mask hides those past {window}"))
    return ops


@dataclass(frozen=True, slots=True)
class ShiftCheck:
    """Live check: notes prefilled at 0 and shifted by ``delta`` against a prefill at ``delta``."""

    delta: int
    status: str
    max_kv_error: float | None  # max |shifted - prefilled| over every layer's keys and values
    max_logit_error: float | None  # the same for next-token logits after one more token
    error: str | None = None  # the documented error, where shifting is unsupported

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class ShiftEngine(Protocol):
    """What :func:`check_shift` uses of an engine (positions sit below the engine, so they name
    it by what it does)."""

    adapter: PositionAdapter

    def prefill(self, x: list[int], start: int = 0) -> Any: ...

    def next_logits(self, nb: Any, query: list[int]) -> torch.Tensor: ...


def check_shift(engine: ShiftEngine, token_ids: list[int], delta: int = 37) -> ShiftCheck:
    """Measure ``prefill(ids, 0).shifted(delta)`` against ``prefill(ids, delta)`` on ``engine``."""
    from kvnotes.core.errors import KvnotesError

    adapter = engine.adapter
    status, _ = shift_status(adapter)
    ids, probe = token_ids[:-1], token_ids[-1:]
    at_zero = engine.prefill(ids, 0)
    at_delta = engine.prefill(ids, delta)
    try:
        moved = at_zero.shifted(delta, allow_approximate=True)
    except KvnotesError as err:
        return ShiftCheck(delta, status, None, None, f"{type(err).__name__}: {err}")
    kv = max(max(float((moved.keys(i) - at_delta.keys(i)).abs().max()),
                 float((moved.values(i) - at_delta.values(i)).abs().max()))
             for i in range(len(moved.layers)))
    with torch.inference_mode():
        logits = float((engine.next_logits(moved, probe)
                        - engine.next_logits(at_delta, probe)).abs().max())
    return ShiftCheck(delta, status, kv, logits)
