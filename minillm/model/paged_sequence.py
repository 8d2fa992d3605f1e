"""One sequence's share of the paged pool (``paged_kv_cache.KVCachePool``): its block table and length.

A :class:`PagedSequence` has lesson 1's ``KVCache`` interface, so the forward takes either; every
address (slot, block, hash) is the pool's to compute: a sequence asks it.
"""

from __future__ import annotations

import numpy as np

from minillm.errors import InvalidRequestError, KVCacheFullError
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import CacheWindow, check_shape


class PagedSequence(CacheWindow):
    """One sequence's view of a ``KVCachePool`` (``pool``): its block table and ``length``.

    It has :class:`~minillm.model.kv_cache.KVCache`'s interface (``length``, ``max_seq_len``,
    ``check_room``, ``write``, ``advance``, ``reset``, sizes), so ``Transformer.forward`` and
    ``forward_batch`` take it where they take a contiguous cache. ``identity``: bytes naming what
    its keys and values depend on besides the token ids (the first block's hash starts from them).
    """

    def __init__(self, pool, max_seq_len: int, identity: bytes = b""):
        if max_seq_len <= 0:
            raise InvalidRequestError(f"a sequence's max_seq_len must be positive, got {max_seq_len}.")
        self.pool, self.max_seq_len, self.identity = pool, max_seq_len, identity
        self.block_table: list[int] = []  # physical block of positions j*block_size .. (j+1)*block_size - 1
        self.hashes: list[bytes] = []  # chained hashes of its full blocks, as registered
        self.length = 0  # positions whose keys and values are in the pool
        self.cached_tokens = 0  # positions reused from the prefix cache at the last allocation
        self._slots = np.zeros(0, dtype=np.int64)

    # --- sizes, as KVCache ---------------------------------------------------------------------------
    num_layers = property(lambda self: self.pool.num_layers)
    num_kv_heads = property(lambda self: self.pool.num_kv_heads)
    head_dim = property(lambda self: self.pool.head_dim)
    bytes_per_token = property(lambda self: self.pool.bytes_per_token)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence holds (shared blocks counted in full)."""
        return len(self.block_table) * self.pool.bytes_per_block

    # --- writing and reading -------------------------------------------------------------------------
    def check_room(self, seq: int) -> None:
        """Raise :class:`KVCacheFullError` unless ``seq`` more positions fit the window and the held blocks."""
        if self.length + seq > self.max_seq_len:
            raise KVCacheFullError(
                f"this sequence holds at most {self.max_seq_len:,} positions, {self.length:,} are filled and "
                f"{seq:,} more were asked for; lower max_new_tokens or shorten the prompt."
            )
        if self.length + seq > len(self.block_table) * self.pool.block_size:
            raise KVCacheFullError(
                f"this sequence holds {len(self.block_table)} blocks ({len(self.block_table) * self.pool.block_size} "
                f"positions), {self.length:,} are filled and {seq:,} more were asked for; call pool.grow(seq, "
                f"{seq}) first."
            )

    def check_compatible(self, config: ModelConfig) -> None:
        """Raise :class:`KVCacheMismatchError` if the pool was built for another model's shape."""
        check_shape(config, self, "KV cache pool", "KVCachePool.for_model(model.config, kv_cache_mib)")

    def slots(self, end: int) -> np.ndarray:
        """Pool slots of positions ``0..end-1`` ``[end]`` int64: ``table[p // bs] * bs + p % bs``."""
        if len(self._slots) != end:  # the same for every layer of one forward pass: computed once
            self._slots = self.pool.slots(np.asarray(self.block_table, dtype=np.int64), np.arange(end))
        return self._slots

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store ``k``, ``v`` ``[n_kv_heads, seq, head_dim]`` at positions ``length..length+seq-1``;
        return this sequence's keys and values ``[n_kv_heads, length+seq, head_dim]``, gathered
        from its blocks in position order (copies: the blocks are scattered in the pool)."""
        slots = self.slots(self.length + k.shape[1])
        self.pool.write_slots(layer, slots[self.length :], k, v)
        return self.pool.read_slots(layer, slots)

    def advance(self, seq: int) -> None:
        """Mark ``seq`` more positions as filled (after every layer has written them)."""
        self.length += seq

    # --- lifecycle -----------------------------------------------------------------------------------
    def truncate(self, length: int) -> None:
        """Forget positions ``length..``, as ``KVCache.truncate``; whole tail blocks return to the pool
        (:meth:`KVCachePool.truncate`)."""
        self.pool.truncate(self, length)

    def reset(self) -> None:
        """Give every block back to the pool (cached prefixes stay findable until evicted)."""
        self.pool.release(self)

    free = reset

    def __repr__(self) -> str:
        return f"PagedSequence(length={self.length}/{self.max_seq_len}, blocks={self.block_table})"
