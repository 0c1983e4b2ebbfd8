"""Chained hashes of full KV-cache blocks.

A block's hash covers its own token ids and, through its parent's hash, every token before it, so
equal hashes mean equal prefixes and a hit on block i implies the whole prefix up to block i matches.
SHA-256 keeps collisions (which would silently serve another prompt's KV) out of the picture, and it is
stable across processes, unlike Python's salted hash of str/bytes.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import Sequence

from kvcore.request import Request

BlockHash = bytes

# The parent of a request's first block: a fixed value, so hashes are equal across processes and runs.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"kvray-prefix-cache-root").digest()

# Token ids are packed as signed 64-bit integers, so any id a tokenizer produces encodes without loss.
_TOKEN_TYPECODE = "q"

_sha256 = hashlib.sha256
# One precompiled packer per block length: "=Nq" (native order, standard size) yields exactly the bytes of
# array("q", ids).tobytes(), at about half the cost, and a decode step hashes one block per request.
_packers: dict[int, struct.Struct] = {}


def _packer(n: int) -> struct.Struct:
    """Made once per block length; hash_block_tokens looks it up in _packers first."""
    packer = _packers[n] = struct.Struct(f"={n}{_TOKEN_TYPECODE}")
    return packer


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block: sha256(parent hash || the block's token ids as int64)."""
    packer = _packers.get(len(token_ids)) or _packer(len(token_ids))
    try:
        packed = packer.pack(*token_ids)
    except struct.error:
        # Out-of-range or non-integer ids: let array raise its usual OverflowError / TypeError.
        packed = array(_TOKEN_TYPECODE, token_ids).tobytes()
    return _sha256((ROOT_BLOCK_HASH if parent_hash is None else parent_hash) + packed).digest()


def compute_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: must be >= 1")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def update_request_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend `request.block_hashes` to cover every full block of `request.all_token_ids`.

    Incremental: only blocks that became full since the last call are hashed, so a decode step costs
    one hash per `block_size` tokens. Prompt and output tokens are treated alike.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: must be >= 1")
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
