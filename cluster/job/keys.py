"""Compact sets of request keys for the batch job: ids already answered (resume) and ids seen in the
input (duplicates). A million-line input must not cost a million Python strings, so a key is kept
as a 64-bit BLAKE2 digest: a sorted numpy array plus a small set of recent additions merged into it.
About 8 bytes a key; two distinct keys collide with probability ~n^2 / 2^65 (3e-8 at 1e6 keys).
"""

from __future__ import annotations

import hashlib

import numpy as np

_MERGE_AT = 1 << 16


def key_hash(key: str) -> int:
    # surrogatepass: a key is hashed before its line is validated, and hashing must never raise.
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class KeySet:
    def __init__(self) -> None:
        self._sorted = np.empty(0, dtype=np.int64)
        self._recent: set[int] = set()

    def add(self, key: str) -> None:
        self._recent.add(key_hash(key))
        if len(self._recent) >= _MERGE_AT:
            self._merge()

    def __contains__(self, key: str) -> bool:
        h = key_hash(key)
        if h in self._recent:
            return True
        i = int(np.searchsorted(self._sorted, h))
        return i < len(self._sorted) and int(self._sorted[i]) == h

    @property
    def nbytes(self) -> int:
        """The memory the digests take (8 bytes each)."""
        return int(self._sorted.nbytes)

    def __len__(self) -> int:
        self._merge()
        return len(self._sorted)

    def _merge(self) -> None:
        if self._recent:
            new = np.fromiter(self._recent, dtype=np.int64, count=len(self._recent))
            self._sorted = np.union1d(self._sorted, new)
            self._recent.clear()
