"""The hf engine's prefix cache: each finished row's KV, reused by a later call whose row extends it.

A multi-turn episode calls ``generate`` once per turn with its whole context (prompt, earlier turns,
observations), and every turn's context begins with the previous turn's. The engine keeps each finished
row's per-layer keys and values (unpadded, shape ``(heads, n, head_dim)``) under the row's tokens; the next
call looks up each row's longest cached prefix and prefills only the rest, as vLLM's prefix cache does.

Lookup is exact on tokens: a row reuses an entry whose whole sequence is a prefix of the row, shorter
than it. Every entry is indexed by ``(length, rolling hash)`` of its tokens, so a row finds its longest
cached prefix in time linear in its own length whatever the number of entries; a hit is checked token by
token. An entry that is a prefix of a newer one is dropped and its index key moves to the newer one, which
holds the same KV in its first columns: an episode keeps one entry, its latest turn, and a row that
extends an earlier turn still finds it. Entries are evicted least recently used first under a byte
budget.

Entries are valid only for the weights that computed them: :meth:`PrefixCache.clear` (on every weight
update and on sleep) advances ``epoch``, and :meth:`PrefixCache.insert` refuses KV computed under an older
epoch, e.g. a row whose call saw an update between its decode steps. Pure bookkeeping: no I/O; one lock
makes it safe to share between calls decoding at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (heads, n, head_dim)

_MOD = (1 << 61) - 1  # a Mersenne prime: the rolling hash's modulus
_BASE = 1_000_003


def prefix_hashes(tokens: Sequence[int], known: Sequence[int] = (0,)) -> list[int]:
    """``h[i]`` is the rolling hash of ``tokens[:i]`` (``h[0] = 0``); length ``len(tokens) + 1``.

    ``known``: the hashes of a prefix of ``tokens`` already computed (a row's, for the row and its
    continuation), extended rather than recomputed."""
    h = list(known)
    acc = h[-1]
    for t in tokens[len(h) - 1 :]:
        acc = (acc * _BASE + t + 1) % _MOD
        h.append(acc)
    return h


def kv_nbytes(kv: LayerKV) -> int:
    return sum(k.nbytes + v.nbytes for k, v in kv)


@dataclass
class PrefixStats:
    """Counts since the engine started (cleared entries keep their counts)."""

    lookups: int = 0  # rows looked up
    hits: int = 0  # rows that found a cached prefix
    reused_tokens: int = 0  # tokens whose KV came from the cache instead of a prefill
    inserted: int = 0
    evicted: int = 0  # dropped for the byte budget (not superseded, not cleared)


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    kv: LayerKV
    nbytes: int
    keys: set[tuple[int, int]] = field(default_factory=set)  # (length, hash) index keys pointing here


class PrefixCache:
    """Token sequences -> their per-layer KV, LRU under ``max_bytes`` (see the module docs)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"prefix cache: max_bytes must be >= 0 (got {max_bytes})")
        self.max_bytes = max_bytes
        self.epoch = 0
        self.nbytes = 0
        self.stats = PrefixStats()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id, least recently used first
        self._index: dict[tuple[int, int], int] = {}  # (prefix length, prefix hash) -> entry id
        self._next_id = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry and advance ``epoch``: KV computed before now is never stored or reused."""
        with self._lock:
            self._entries.clear()
            self._index.clear()
            self.nbytes = 0
            self.epoch += 1

    def longest(self, row: Sequence[int], hashes: list[int] | None = None) -> tuple[int, LayerKV] | None:
        """The longest cached prefix of ``row`` shorter than it (at least one token is left to feed):
        ``(n, kv)`` with ``kv`` the first ``n`` columns of the entry's KV, or None. ``hashes``: the row's
        :func:`prefix_hashes`, when the caller has them."""
        h = hashes if hashes is not None else prefix_hashes(row)
        with self._lock:
            self.stats.lookups += 1
            for n in range(len(row) - 1, 0, -1):
                eid = self._index.get((n, h[n]))
                if eid is None:
                    continue
                entry = self._entries[eid]
                if entry.tokens[:n] != tuple(row[:n]):  # a hash collision
                    continue
                self._entries.move_to_end(eid)
                self.stats.hits += 1
                self.stats.reused_tokens += n
                return n, [(k[:, :n], v[:, :n]) for k, v in entry.kv]
        return None

    def insert(self, tokens: Sequence[int], kv: LayerKV, epoch: int, hashes: list[int] | None = None) -> bool:
        """Keep ``kv`` (per layer, ``(heads, len(tokens), head_dim)``) for ``tokens``; False when it was
        computed under an older ``epoch`` or alone exceeds the budget. ``hashes`` as in :meth:`longest`."""
        if not tokens or any(k.shape[1] != len(tokens) or v.shape[1] != len(tokens) for k, v in kv):
            raise ValueError(
                f"prefix cache: KV of {[tuple(k.shape) for k, _ in kv]} for {len(tokens)} tokens"
            )
        nbytes = kv_nbytes(kv)
        h = hashes if hashes is not None else prefix_hashes(tokens)
        with self._lock:
            if epoch != self.epoch or nbytes > self.max_bytes:
                return False
            entry = _Entry(tuple(tokens), kv, nbytes)
            n = len(tokens)
            entry.keys = {(n, h[n])}
            for old_id in self._prefix_entries(entry, h):  # superseded: their keys move here
                entry.keys |= self._entries[old_id].keys
                self._drop(old_id)
            while self.nbytes + nbytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.stats.evicted += 1
            eid, self._next_id = self._next_id, self._next_id + 1
            self._entries[eid] = entry
            for key in entry.keys:
                self._index[key] = eid
            self.nbytes += nbytes
            self.stats.inserted += 1
            return True

    def _prefix_entries(self, entry: _Entry, h: list[int]) -> list[int]:
        """Ids of the entries whose whole token sequence is a prefix of ``entry``'s (or equals it)."""
        found = []
        for n in range(len(entry.tokens), 0, -1):
            eid = self._index.get((n, h[n]))
            if eid is not None and eid not in found:
                old = self._entries[eid]
                if len(old.tokens) == n and old.tokens == entry.tokens[:n]:
                    found.append(eid)
        return found

    def _drop(self, eid: int) -> None:
        entry = self._entries.pop(eid)
        for key in entry.keys:
            if self._index.get(key) == eid:
                del self._index[key]
        self.nbytes -= entry.nbytes


def left_padded_kv(hits: Sequence[tuple[int, LayerKV] | None]) -> tuple[LayerKV, list[int]]:
    """One batch's cached KV, each row's left-padded with zeros to the longest: per layer
    ``(B, heads, C, head_dim)``, and each row's cached length (0 for a miss). At least one hit."""
    lengths = [hit[0] if hit is not None else 0 for hit in hits]
    width = max(lengths)
    ref = next(hit[1] for hit in hits if hit is not None)
    if min(lengths) == width:  # every row hit, alike (an episode round): no padding, one copy per layer
        rows = [hit[1] for hit in hits if hit is not None]
        keys = [torch.stack([kv[layer][0] for kv in rows]) for layer in range(len(ref))]
        values = [torch.stack([kv[layer][1] for kv in rows]) for layer in range(len(ref))]
        return list(zip(keys, values, strict=True)), lengths
    out: LayerKV = []
    for layer, (k0, v0) in enumerate(ref):
        keys = k0.new_zeros((len(hits), k0.shape[0], width, k0.shape[2]))
        values = v0.new_zeros((len(hits), v0.shape[0], width, v0.shape[2]))
        for i, hit in enumerate(hits):
            if hit is not None:
                k, v = hit[1][layer]
                keys[i, :, width - hit[0] :] = k
                values[i, :, width - hit[0] :] = v
        out.append((keys, values))
    return out, lengths
