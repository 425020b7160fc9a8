"""Position adapters: the only place that knows how an architecture encodes token positions.

Keys are stored post-RoPE, exactly as transformers caches hold them. Moving cached notes by
``delta`` positions is therefore a rotation of the stored keys by ``R(delta)``; values never
carry positions. Each adapter declares what it can do with class flags (``supported``,
``exact_shift``, ``approximate``) and one verb, :meth:`PositionAdapter.shift_layer`.
"""

from kvnotes.positions.base import PositionAdapter, adapter_for, register_adapter
from kvnotes.positions.rope import RopeAdapter

__all__ = ["PositionAdapter", "RopeAdapter", "adapter_for", "register_adapter"]
