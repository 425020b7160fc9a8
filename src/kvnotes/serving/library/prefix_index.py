"""Many keys found in one sequence at a cost that does not grow with how many keys there are.

:class:`PrefixIndex` holds keys (strings, or tuples of token ids) and answers two questions
about a sequence of the same kind:

- :meth:`PrefixIndex.starts`: where a key may start. Every window of the sequence the length of
  a key's head (its first ``block`` items, or the whole key when it is shorter) is hashed at once
  with numpy, passed through two small bit filters of the heads' hashes and, where both pass,
  looked up in their sorted hashes: one pass over the sequence per distinct head length (at
  most ``block``), each about ``O(length)`` in compiled code, on tables small enough to stay in
  the CPU's cache.
- :meth:`PrefixIndex.longest_at`: the longest key at one position. Keys are laid in a trie
  whose edges are whole blocks of ``block`` items (as vLLM's and SGLang's prefix caches chain
  block hashes): a lookup walks the blocks the sequence shares with some key, one dict lookup
  each, then compares the few keys that end inside the next block. Once the walk reaches a
  node only one key runs through, that key is compared whole instead (one comparison, not a
  dict lookup per block: in a large trie each lookup is a likely cache miss).

So finding every key in a prompt costs about the prompt's length plus the keys found, with
10 keys or 10,000. Pure (numpy only): the connector's scheduler uses it too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

V = TypeVar("V")
Key = str | tuple[int, ...]  # keys and the sequences searched are of one kind

_BASE = 0x100000001B3  # the window hash: h = h * _BASE + item, modulo 2**64
_MASK = (1 << 64) - 1
# a window's slot in each of the two filters: the high bits of hash * mix (one mix each)
_MIXES = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
FILTER_SLOTS_PER_KEY = 64  # each filter's size while under its cap
# each filter at most 2**16 slots (64 KiB): both stay in a core's cache where one filter of 64
# slots per key (512 KiB at 8k keys) is evicted by the tokenizer between requests, and each
# of its gathers is then a miss; two capped filters pass as few windows falsely (about 1 in 80
# at 8k keys) for a quarter of the memory
FILTER_MAX_BITS = 16


def codes(seq: str | Sequence[int]) -> np.ndarray:
    """uint64[len(seq)]: a string's code points, or the token ids as they are."""
    if isinstance(seq, str):
        return np.frombuffer(seq.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    return np.asarray(seq, dtype=np.int64).astype(np.uint64)


def head_hash(head: str | Sequence[int]) -> int:
    """The window hash of ``head`` (what :func:`window_hashes` gives for a window equal to it)."""
    h = 0
    for item in head:
        h = (h * _BASE + (ord(item) if isinstance(item, str) else int(item))) & _MASK
    return h


def window_hashes(items: np.ndarray, lengths: Sequence[int]) -> Iterator[tuple[int, np.ndarray]]:
    """``(n, hashes)`` for each ``n`` of ``lengths`` (ascending) that fits in ``items``:
    ``hashes[i]`` is the hash of ``items[i:i + n]``. Windows of 2, 4, 8... items are made by
    doubling (``h[2k] = h[k] * B**k + h[k] shifted by k``) and a window of ``n`` from the
    powers of two that sum to it: a few passes over ``items``, not ``n``."""
    top = max((n for n in lengths if n <= len(items)), default=0)
    pows: dict[int, np.ndarray] = {1: items}
    with np.errstate(over="ignore"):
        k = 1
        while 2 * k <= top:
            h = pows[k]
            pows[2 * k] = h[:-k] * np.uint64(pow(_BASE, k, 1 << 64)) + h[k:]
            k *= 2
        for n in sorted(set(lengths)):
            if n > top:
                return
            acc: np.ndarray | None = None
            got = 0
            for p in sorted(pows, reverse=True):
                if got + p > n:
                    continue
                h = pows[p]
                acc = h if acc is None else (
                    acc[:len(h) - got] * np.uint64(pow(_BASE, p, 1 << 64)) + h[got:])
                got += p
            assert acc is not None and got == n
            yield n, acc


def _slots(hashes: np.ndarray, bits: int, mix: int) -> np.ndarray:
    """Each hash's slot in a filter of ``2**bits`` (its multiplied high bits: well mixed)."""
    with np.errstate(over="ignore"):
        return ((hashes * np.uint64(mix)) >> np.uint64(64 - bits)).astype(np.intp)


@dataclass(frozen=True, slots=True)
class _Heads:
    """The heads of one length: their sorted hashes, and two filters of ``2**bits`` slots
    (a slot is set where some head's hash falls, one mix per filter)."""

    table: np.ndarray
    bits: int
    filters: tuple[np.ndarray, ...]

    def find(self, hashes: np.ndarray) -> np.ndarray:
        """The indices of ``hashes`` that are some head's hash, ascending."""
        maybe = np.flatnonzero(self.filters[0][_slots(hashes, self.bits, _MIXES[0])])
        some = hashes[maybe]
        for passes, mix in zip(self.filters[1:], _MIXES[1:], strict=True):
            kept = passes[_slots(some, self.bits, mix)]
            maybe, some = maybe[kept], some[kept]
        table = self.table
        at = np.minimum(np.searchsorted(table, some), len(table) - 1)
        out: np.ndarray = maybe[table[at] == some]
        return out


@dataclass
class _Node:
    parent: int
    block: Key
    refs: int = 0  # keys whose path runs through this node
    # the key that made this node: the one through it while refs is 1 (None once removed:
    # the node's remaining key is then found by walking)
    key: Key | None = None


def _holds(seq: Key, pos: int, key: Key) -> bool:
    """Whether ``seq`` holds ``key`` at ``pos``."""
    if isinstance(seq, str) and isinstance(key, str):
        return seq.startswith(key, pos)
    return seq[pos:pos + len(key)] == key


@dataclass
class PrefixIndex(Generic[V]):
    """Keys to values; the longest key at a position, and where keys may start (see the
    module docstring). ``block``: the trie's edge length, and the head length hashed.

    Example:
        >>> idx: PrefixIndex[str] = PrefixIndex(block=4)
        >>> idx.add("POLICY", "p"); idx.add("POL", "short")
        >>> text = "Hi POLICY there"
        >>> [(at, idx.longest_at(text, at)) for at in idx.starts(text)]
        [(3, ('POLICY', 'p'))]
    """

    block: int = 8
    _values: dict[Key, V] = field(default_factory=dict)
    _children: dict[tuple[int, Key], int] = field(default_factory=dict)  # (node, block) -> node
    _nodes: dict[int, _Node] = field(default_factory=dict)
    _tails: dict[int, list[tuple[Key, Key]]] = field(default_factory=dict)  # (rest, key)
    _short: dict[int, int] = field(default_factory=dict)  # length under block -> keys
    _heads: dict[int, dict[int, int]] = field(default_factory=dict)  # length -> hash -> keys
    _sorted: dict[int, _Heads] | None = None  # head length -> its heads; made on demand
    _next: int = 1  # the next node id (0: the root)

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"block must be at least 1, got {self.block}")

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def get(self, key: Key) -> V | None:
        return self._values.get(key)

    def items(self) -> Iterator[tuple[Key, V]]:
        return iter(self._values.items())

    def add(self, key: Key, value: V) -> None:
        """Index ``key`` (non-empty) with ``value``; a key already indexed gets the new value."""
        if not key:
            raise ValueError("an indexed key is not empty")
        if key in self._values:
            self._values[key] = value
            return
        self._values[key] = value
        b = self.block
        head = key[:b]
        counts = self._heads.setdefault(len(head), {})
        h = head_hash(head)
        counts[h] = counts.get(h, 0) + 1
        self._sorted = None
        if len(key) < b:
            self._short[len(key)] = self._short.get(len(key), 0) + 1
            return
        node = 0
        depth = len(key) // b
        for d in range(depth):
            blk = key[d * b:(d + 1) * b]
            child = self._children.get((node, blk))
            if child is None:
                child = self._next
                self._next += 1
                self._children[(node, blk)] = child
                self._nodes[child] = _Node(node, blk, key=key)
            self._nodes[child].refs += 1
            node = child
        tails = self._tails.setdefault(node, [])
        tails.append((key[depth * b:], key))
        tails.sort(key=lambda t: len(t[0]), reverse=True)  # longest first, stable

    def remove(self, key: Key) -> None:
        """Forget ``key`` (nothing when it is not indexed)."""
        if key not in self._values:
            return
        del self._values[key]
        b = self.block
        head = key[:b]
        counts = self._heads.get(len(head), {})
        h = head_hash(head)
        if counts.get(h, 0) <= 1:
            counts.pop(h, None)
        else:
            counts[h] -= 1
        self._sorted = None
        if len(key) < b:
            self._short[len(key)] -= 1
            if not self._short[len(key)]:
                del self._short[len(key)]
            return
        node = 0
        path = []
        for d in range(len(key) // b):
            node = self._children[(node, key[d * b:(d + 1) * b])]
            path.append(node)
        tails = [t for t in self._tails[node] if t[1] != key]
        if tails:
            self._tails[node] = tails
        else:
            del self._tails[node]
        for node in path:
            n = self._nodes[node]
            n.refs -= 1
            if n.key == key:
                n.key = None
            if not n.refs:
                del self._children[(n.parent, n.block)]
                del self._nodes[node]

    def longest_at(self, seq: Key, pos: int) -> tuple[Key, V] | None:
        """``(key, value)`` of the longest key ``seq`` holds at ``pos``; None when none does.
        ``seq`` is of the keys' kind (a str, or a tuple: a list never equals a tuple)."""
        b = self.block
        path: list[int] = []
        node = 0
        while True:
            at = pos + len(path) * b
            child = self._children.get((node, seq[at:at + b]))
            if child is None:
                break
            only = self._nodes[child]
            if only.refs == 1 and only.key is not None:
                # no other key runs through the child: it is the longest here, or none deeper is
                if _holds(seq, pos, only.key):
                    return only.key, self._values[only.key]
                break
            node = child
            path.append(node)
        for depth in range(len(path), 0, -1):
            at = pos + depth * b
            for rest, key in self._tails.get(path[depth - 1], ()):
                if seq[at:at + len(rest)] == rest:
                    return key, self._values[key]
        for n in sorted(self._short, reverse=True):
            head = seq[pos:pos + n]
            if len(head) == n and head in self._values:
                return head, self._values[head]
        return None

    def starts(self, seq: str | Sequence[int]) -> list[int]:
        """The positions of ``seq`` where a key may start, ascending: every position where one
        does, and a few where only a head's hash matches (:meth:`longest_at` tells).

        Each window's hash goes through two filters first (one bit per slot, one gather
        each, whatever the number of keys: :data:`FILTER_SLOTS_PER_KEY`, :data:`FILTER_MAX_BITS`);
        only the windows both pass are looked up in the sorted hashes."""
        if not self._values or not len(seq):
            return []
        tables = self._tables()
        found = [tables[n].find(hashes)
                 for n, hashes in window_hashes(codes(seq), sorted(tables))]
        if not found:
            return []
        out: list[int] = np.unique(np.concatenate(found)).tolist()
        return out

    def _tables(self) -> dict[int, _Heads]:
        """Per head length: its heads' sorted hashes and filters."""
        if self._sorted is None:
            tables = {}
            for n, counts in self._heads.items():
                if not counts:
                    continue
                table = np.sort(np.fromiter(counts, dtype=np.uint64, count=len(counts)))
                bits = min(FILTER_MAX_BITS,
                           max(10, (len(table) * FILTER_SLOTS_PER_KEY - 1).bit_length()))
                filters = []
                for mix in _MIXES:
                    passes = np.zeros(1 << bits, dtype=bool)
                    passes[_slots(table, bits, mix)] = True
                    filters.append(passes)
                tables[n] = _Heads(table, bits, tuple(filters))
            self._sorted = tables
        return self._sorted
