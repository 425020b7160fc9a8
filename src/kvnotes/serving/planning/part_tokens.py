"""An exact cache of prompt parts' token ids: a part seen before is not tokenized again.

The front lays a prompt out part by part (:func:`~kvnotes.serving.planning.layout.part_ids`):
BOS, then each part encoded alone. A part's ids then depend on its text and the tokenizer
only, never on the parts around it, so the ids kept under a part's exact text are the ids
encoding it gives: a server that sees the same long context again (a system prompt, a
document, the turns so far) with a new question tokenizes only the new part.

:class:`PartTokenCache` is a least-recently-used map from a part's text to its ids, bounded
by the characters of the texts it holds and by its entries. One cache serves one tokenizer
and its copies (the front's planning threads each tokenize with a copy, and copies encode
alike); it is thread-safe, and a part is tokenized outside its lock.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from typing import Any

from kvnotes.core.document import encode
from kvnotes.core.errors import InvalidArgumentError

DEFAULT_CHARS = 8_000_000  # about 16 MB: the texts, their ids (4 bytes a token), the map
DEFAULT_ENTRIES = 65_536  # a bound on the map's own size when the parts are tiny
# ids kept as 4-byte unsigned ints (a tuple of Python ints costs 36 bytes a token)
_TYPECODE = "I" if array("I").itemsize >= 4 else "L"


class PartTokenCache:
    """Token ids of parts encoded alone, by their exact text (see the module docstring).

    Args:
        max_chars: the characters of all cached texts together; the least recently used
            parts are dropped beyond it (a part longer than this alone is never kept).
        max_entries: the parts kept at most.

    Example:
        >>> class Chars:  # a stand-in tokenizer: one id per character
        ...     def __call__(self, text, add_special_tokens=False):
        ...         return {"input_ids": [ord(c) for c in text]}
        >>> cache = PartTokenCache(max_chars=4)
        >>> cache.encode(Chars(), "ab"), cache.encode(Chars(), "ab"), (cache.hits, cache.misses)
        ([97, 98], [97, 98], (1, 1))
        >>> _ = cache.encode(Chars(), "cde"); len(cache), cache.chars  # "ab" dropped
        (1, 3)
    """

    def __init__(self, max_chars: int = DEFAULT_CHARS,
                 max_entries: int = DEFAULT_ENTRIES) -> None:
        for name, value in (("max_chars", max_chars), ("max_entries", max_entries)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"PartTokenCache.{name} must be a positive "
                                           f"integer, got {value!r}")
        self.max_chars, self.max_entries = max_chars, max_entries
        self._lock = threading.Lock()
        self._ids: OrderedDict[str, array[int]] = OrderedDict()
        self._chars = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def chars(self) -> int:
        """The characters of the texts held now."""
        return self._chars

    def encode(self, tokenizer: Any, text: str) -> list[int]:
        """``text``'s token ids encoded alone, no special tokens
        (:func:`kvnotes.core.document.encode`): kept ones when ``text`` was seen, else
        ``tokenizer``'s, then kept."""
        with self._lock:
            ids = self._ids.get(text)
            if ids is not None:
                self._ids.move_to_end(text)
                self.hits += 1
                return ids.tolist()
            self.misses += 1
        fresh = encode(tokenizer, text)
        if len(text) <= self.max_chars:
            try:
                self._keep(text, array(_TYPECODE, fresh))
            except OverflowError:  # an id beyond 4 bytes: not kept, still exact
                pass
        return fresh

    def _keep(self, text: str, ids: array[int]) -> None:
        with self._lock:
            if text in self._ids:  # another thread encoded it meanwhile
                return
            self._ids[text] = ids
            self._chars += len(text)
            while self._chars > self.max_chars or len(self._ids) > self.max_entries:
                old, _ = self._ids.popitem(last=False)
                self._chars -= len(old)

    def clear(self) -> None:
        """Forget every part (the hit and miss counts stay)."""
        with self._lock:
            self._ids.clear()
            self._chars = 0
