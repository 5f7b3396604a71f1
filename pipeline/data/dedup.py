"""Exact-duplicate detection for the clean stage: one 16-byte digest per kept pair, never the text, so
corpora of any size stream through."""

from __future__ import annotations

import hashlib

import numpy as np


def pair_digest(src: str, tgt: str) -> bytes:
    """16-byte digest of a normalised pair (``\\n`` cannot occur inside a line: unambiguous)."""
    return hashlib.blake2b(f"{src}\n{tgt}".encode(), digest_size=16).digest()


class DigestSet:
    """A set of 16-byte digests in an open-addressing numpy table, batched and vectorised: ~34 bytes per entry
    where a Python ``set`` of ``bytes`` takes ~100."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._keys = np.zeros((capacity, 2), dtype=np.uint64)
        self._used = np.zeros(capacity, dtype=bool)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def _grow(self) -> None:
        old_keys, old_used = self._keys, self._used
        cap = 2 * len(old_used)
        self._keys = np.zeros((cap, 2), dtype=np.uint64)
        self._used = np.zeros(cap, dtype=bool)
        self._n = 0
        step = 1 << 18  # rehash in chunks: no full copy of the old keys
        for i in range(0, len(old_used), step):
            self._insert_unique(old_keys[i:i + step][old_used[i:i + step]])

    def _insert_unique(self, keys: np.ndarray) -> np.ndarray:
        """Insert distinct ``keys`` [m, 2]; return a mask of those that were not present."""
        mask = len(self._used) - 1
        slot = (keys[:, 0] & np.uint64(mask)).astype(np.int64)
        new = np.zeros(len(keys), dtype=bool)
        todo = np.arange(len(keys))
        while len(todo):
            s = slot[todo]
            used = self._used[s]
            same = used & np.all(self._keys[s] == keys[todo], axis=1)
            # Empty slot: the first claimant (lowest index) takes it; the others probe again.
            empty = ~used
            claim = np.zeros(len(todo), dtype=bool)
            if empty.any():
                cand = np.flatnonzero(empty)
                _, first = np.unique(s[cand], return_index=True)
                claim[cand[first]] = True
                won = todo[claim]
                self._keys[slot[won]] = keys[won]
                self._used[slot[won]] = True
                new[won] = True
                self._n += len(won)
            keep = ~(same | claim)
            todo = todo[keep]
            slot[todo] = (slot[todo] + 1) & mask
        return new

    def add_batch(self, digests: list[bytes] | bytes) -> np.ndarray:
        """Add digests in order (a list, or 16-byte digests back to back); return a bool mask, True where a
        digest is seen for the first time."""
        if not digests:
            return np.zeros(0, dtype=bool)
        joined = digests if isinstance(digests, bytes) else b"".join(digests)
        keys = np.frombuffer(joined, dtype=np.uint64).reshape(-1, 2)
        _, first = np.unique(keys.view(np.dtype((np.void, 16))).ravel(), return_index=True)
        first.sort()
        while (self._n + len(first)) * 2 > len(self._used):
            self._grow()
        result = np.zeros(len(keys), dtype=bool)
        result[first] = self._insert_unique(keys[first])
        return result
