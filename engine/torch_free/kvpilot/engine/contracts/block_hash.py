"""Content hashes of KV-cache blocks, chained over the prefix; torch-free.

The router (prefix affinity) and the KV transfer (block import) compute the same
hashes as the engine's prefix cache, so the function must be deterministic across
processes and machines: blake2b over fixed-width little-endian bytes, never
Python's salted ``hash``. A fleet with a secret keys the blake2b with the salt its
members derive from it (`FleetSecret.block_hash_salt`): its hashes then confirm no
guessed prompt to an outsider and never collide with another fleet's. The empty
salt is plain (unkeyed) blake2b.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence

_NO_PARENT = b"\xff" * 8
UNSALTED = b""


@functools.lru_cache(maxsize=16)
def _keyed(salt: bytes) -> hashlib.blake2b:
    """Gives a blake2b keyed by `salt`, to copy per block (as fast as an unkeyed one)."""
    return hashlib.blake2b(digest_size=8, key=salt)


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int],
                      salt: bytes = UNSALTED) -> int:
    """Gives the 64-bit hash of one block given its parent block's hash and its token ids."""
    digest = _keyed(salt).copy()
    digest.update(_NO_PARENT if parent_hash is None else parent_hash.to_bytes(8, "little"))
    digest.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return int.from_bytes(digest.digest(), "little")


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, parent_hash: int | None = None,
                       salt: bytes = UNSALTED) -> list[int]:
    """Gives the chained hashes of the full blocks of `token_ids` (a trailing partial block has none)."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start:start + block_size], salt)
        hashes.append(parent_hash)
    return hashes


def hash_prompt_tail(token_ids: Sequence[int], block_size: int, full_hashes: Sequence[int],
                     salt: bytes = UNSALTED) -> int | None:
    """Gives the hash of the prompt's trailing partial block (chained to its full blocks), or
    None when the prompt ends on a block boundary.

    A prefill engine caches its prompt's partial last block under this hash when the
    prompt is done, so a KV transfer can carry it and the decode engine computes only
    the prompt's last token. `full_hashes` are `hash_prompt_blocks(token_ids, block_size)`
    with the same salt.
    """
    start = len(token_ids) // block_size * block_size
    if start == len(token_ids):
        return None
    parent = full_hashes[start // block_size - 1] if start else None
    return hash_block_tokens(parent, token_ids[start:], salt)
