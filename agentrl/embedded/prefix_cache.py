"""Prefix reuse for the embedded engine: which cache slot holds the KV of the longest prefix of a prompt.

When a sequence leaves the engine (finished, aborted or retracted), the KV of its tokens is copied into
one of the cache slots; this index remembers those tokens. A new request (an episode's next turn, which
is the previous turn's prompt + output + the observation; or another sample of the same prompt) looks up
the longest cached prefix of its tokens, copies that much KV into its own slot and prefills only the rest.

Tokens are indexed in blocks of ``block`` ids by a hash chain (block ``i``'s key covers blocks ``0..i``),
so a lookup walks the prompt once; the match is then checked token by token and extended past the last
whole block. Slots are reused least-recently-used first. A weight update clears the index (the KV was
computed with the old weights).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class _Entry:
    tokens: list[int]
    keys: list[int] = field(default_factory=list)


def _chain(tokens: list[int], block: int) -> Iterator[int]:
    """The chain keys of the whole blocks of ``tokens``: key ``i`` covers blocks ``0..i``."""
    h = 0
    for i in range(len(tokens) // block):
        h = hash((h, tuple(tokens[i * block : (i + 1) * block])))
        yield h


class PrefixCache:
    """An index from token prefixes to the cache slots ``slots`` (LRU)."""

    def __init__(self, slots: list[int], block: int = 16) -> None:
        self.block = block
        self.num_slots = len(slots)
        self._free = list(reversed(slots))
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # slot -> entry, least recent first
        self._by_key: dict[int, int] = {}  # chain key -> slot

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: list[int], max_len: int) -> tuple[int | None, int]:
        """The slot holding the longest cached prefix of ``tokens`` (at most ``max_len`` of them), and its
        length; (None, 0) when nothing matches. Marks the entry used."""
        slot, n = self._match(tokens, max_len)
        if slot is not None:
            self._entries.move_to_end(slot)
        return slot, n

    def _match(self, tokens: list[int], max_len: int) -> tuple[int | None, int]:
        best_slot, best = None, 0
        for i, key in enumerate(_chain(tokens[:max_len], self.block)):
            slot = self._by_key.get(key)
            if slot is None:
                break
            best_slot, best = slot, (i + 1) * self.block
        if best_slot is None:
            return None, 0
        entry = self._entries[best_slot]
        if entry.tokens[:best] != tokens[:best]:  # a hash collision: ignore the entry
            return None, 0
        limit = min(len(entry.tokens), len(tokens), max_len)
        while best < limit and entry.tokens[best] == tokens[best]:
            best += 1
        return best_slot, best

    def insert(self, tokens: list[int]) -> tuple[int | None, int]:
        """Reserve a slot for the KV of ``tokens`` and index it: the slot of an entry that ``tokens`` extends
        (a conversation's previous turn, replaced in place), else a free one, else the least recently used.
        Returns (slot, positions of it that already hold this KV), or (None, 0) when there is nothing to
        store (an entry already holds all of ``tokens``, or there are no cache slots)."""
        if len(tokens) < self.block:
            return None, 0
        slot, n = self._match(tokens, len(tokens))
        if slot is not None and n == len(tokens):
            return None, 0
        have = 0
        if slot is not None and n == len(self._entries[slot].tokens):
            have = n
            self._unindex(slot, self._entries.pop(slot))
        elif self._free:
            slot = self._free.pop()
        elif self._entries:
            slot, old = self._entries.popitem(last=False)
            self._unindex(slot, old)
        else:
            return None, 0
        entry = _Entry(tokens=list(tokens), keys=list(_chain(tokens, self.block)))
        self._entries[slot] = entry
        for k in entry.keys:
            self._by_key[k] = slot  # the newest entry with this prefix wins
        return slot, have

    def _unindex(self, slot: int, entry: _Entry) -> None:
        for k in entry.keys:
            if self._by_key.get(k) == slot:
                del self._by_key[k]

    def clear(self) -> None:
        for slot in list(self._entries):
            self._free.append(slot)
        self._entries.clear()
        self._by_key.clear()


__all__ = ["PrefixCache"]
