"""The paged KV cache's bookkeeping on the host: a pool of fixed-size blocks shared by every sequence,
and each sequence's block table (as vLLM's PagedAttention). Memory follows actual lengths.

Blocks are counted by reference: a full block whose tokens are known may be registered under the chained
hash of its tokens and of every block before it (:func:`chain_hashes`, as vLLM's prefix caching), so a
later sequence with the same tokens at the same positions takes it (:meth:`BlockPool.take`) instead of
computing it again. A block no sequence holds is free; a free block that is still registered keeps its
contents until the pool needs it (evicted least recently freed first, after the unregistered free
blocks)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from ..errors import RequestError


def pool_rows(table: list[int], positions: int | np.ndarray, block_size: int) -> np.ndarray:
    """The pool rows of token ``positions`` (one, or an array) of the sequence whose blocks are ``table``."""
    return np.asarray(table)[positions // block_size] * block_size + positions % block_size


def default_blocks(max_batch: int, max_context: int, block_size: int) -> int:
    """An engine's KV blocks when not given: room for every slot at a quarter of ``max_context``, and at
    least for one whole context."""
    per_context = -(-max_context // block_size)
    return max(per_context, max_batch * per_context // 4)


def chain_hashes(hashes: list[bytes], tokens: Sequence[int], block_size: int, blocks: int) -> list[bytes]:
    """Extend ``hashes`` (those of a token sequence's first blocks) to its first ``blocks`` full blocks of
    ``tokens``: block ``j``'s is SHA-256 of block ``j - 1``'s and of its own token ids, so equal hashes
    mean equal tokens at equal positions (a cryptographic hash: no prompt can be crafted to collide with
    another's and read its cache). Returns ``hashes``."""
    for j in range(len(hashes), min(blocks, len(tokens) // block_size)):
        parent = hashes[j - 1] if j else b""
        ids = array("q", tokens[j * block_size : (j + 1) * block_size])
        hashes.append(hashlib.sha256(parent + ids.tobytes()).digest())
    return hashes


class BlockPool:
    """``blocks`` KV blocks of ``block_size`` token rows; each sequence holds the blocks its tokens use,
    a registered block possibly shared by several (see the module)."""

    def __init__(self, blocks: int, block_size: int) -> None:
        if blocks < 1 or block_size < 1:
            raise RequestError(f"KV cache: need at least one block of at least one row, got {blocks} x {block_size}")
        self.blocks = blocks
        self.block_size = block_size
        self._free = list(range(blocks - 1, -1, -1))  # unregistered and unheld; pop() hands out the lowest first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered and unheld, least recently freed first
        self._refs = [0] * blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    @property
    def free(self) -> int:
        """Blocks no sequence holds (registered ones among them: their contents go when they are needed)."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Blocks the sequences hold."""
        return self.blocks - self.free

    @property
    def cached(self) -> int:
        """Blocks registered under a hash (held or not)."""
        return len(self._hash_of)

    def usage(self) -> dict[str, int]:
        """Blocks used, free, cached and in all, and the block size (an engine's ``memory()``)."""
        return {
            "blocks_used": self.used,
            "blocks_free": self.free,
            "blocks_cached": self.cached,
            "blocks": self.blocks,
            "block_size": self.block_size,
        }

    def refs(self, block: int) -> int:
        """How many sequences hold ``block``."""
        return self._refs[block]

    def needed(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` rows."""
        return -(-tokens // self.block_size)

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend ``table`` (a sequence's blocks) to hold ``tokens`` rows with blocks of its own; False (and
        nothing taken) when the pool has too few free blocks. Unregistered free blocks go first, then the
        registered ones least recently freed (their hashes forgotten)."""
        missing = self.needed(tokens) - len(table)
        if missing <= 0:
            return True
        if missing > self.free:
            return False
        for _ in range(missing):
            block = self._free.pop() if self._free else self._evict()
            self._refs[block] = 1
            table.append(block)
        return True

    def _evict(self) -> int:
        """The least recently freed registered block, unregistered."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block

    def release(self, table: list[int]) -> None:
        """A sequence gives its blocks back (finished or preempted): each one no other sequence holds is
        free, its last blocks first in line for eviction (a shared prefix stays longest)."""
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        table.clear()

    def register(self, block: int, key: bytes) -> None:
        """``block`` (held, full, its rows written) holds the tokens hashed to ``key``; where another block
        already does, that one stays the registered one."""
        if key not in self._block_of and block not in self._hash_of:
            self._block_of[key] = block
            self._hash_of[block] = key

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of ``hashes`` (block hashes of a token sequence)."""
        found = []
        for key in hashes:
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def take(self, blocks: list[int]) -> None:
        """A sequence holds ``blocks`` (found by :meth:`lookup`) too."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def row(self, table: list[int], position: int) -> int:
        """The pool row of token ``position`` of the sequence owning ``table``."""
        return int(pool_rows(table, position, self.block_size))
