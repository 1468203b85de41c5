"""The paged KV cache's bookkeeping on the host: a pool of fixed-size blocks shared by every sequence,
and each sequence's block table (as vLLM's PagedAttention). Memory follows actual lengths."""

from __future__ import annotations

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


class BlockPool:
    """``blocks`` KV blocks of ``block_size`` token rows; each sequence holds the blocks its tokens use."""

    def __init__(self, blocks: int, block_size: int) -> None:
        if blocks < 1 or block_size < 1:
            raise RequestError(f"KV cache: need at least one block of at least one row, got {blocks} x {block_size}")
        self.blocks = blocks
        self.block_size = block_size
        self._free = list(range(blocks - 1, -1, -1))  # pop() hands out the lowest first

    @property
    def free(self) -> int:
        """Blocks no sequence holds."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Blocks the sequences hold."""
        return self.blocks - len(self._free)

    def needed(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` rows."""
        return -(-tokens // self.block_size)

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend ``table`` (a sequence's blocks) to hold ``tokens`` rows; False (and nothing taken) when the
        pool has too few free blocks."""
        missing = self.needed(tokens) - len(table)
        if missing <= 0:
            return True
        if missing > len(self._free):
            return False
        table.extend(self._free.pop() for _ in range(missing))
        return True

    def release(self, table: list[int]) -> None:
        """Give a finished sequence's blocks back."""
        self._free.extend(reversed(table))
        table.clear()

    def row(self, table: list[int], position: int) -> int:
        """The pool row of token ``position`` of the sequence owning ``table``."""
        return int(pool_rows(table, position, self.block_size))
