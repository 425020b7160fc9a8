"""Position adapters: the only place that knows how an architecture encodes token positions.

Keys are stored post-RoPE, exactly as transformers caches hold them. Moving cached notes by
``delta`` positions is therefore a rotation of the stored keys by ``R(delta)``; values never
carry positions (except MLA's value slot, which holds the rotary key). Each adapter declares
what it can do with class flags (``supported``, ``exact_shift``, ``approximate``) and one verb,
:meth:`PositionAdapter.shift_layer`. One module per scheme; importing registers it.
"""

from kvnotes.core.positions.absolute import LearnedAbsoluteAdapter
from kvnotes.core.positions.alibi import AlibiAdapter
from kvnotes.core.positions.base import PositionAdapter, adapter_for, register_adapter
from kvnotes.core.positions.interleaved import InterleavedRopeAdapter
from kvnotes.core.positions.mla import MlaAdapter
from kvnotes.core.positions.mrope import MropeAdapter
from kvnotes.core.positions.rope import RopeAdapter

__all__ = ["PositionAdapter", "RopeAdapter", "InterleavedRopeAdapter", "MlaAdapter",
           "MropeAdapter", "AlibiAdapter", "LearnedAbsoluteAdapter", "adapter_for",
           "register_adapter"]
