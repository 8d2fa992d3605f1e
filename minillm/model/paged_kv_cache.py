"""The paged KV cache: one pool of fixed-size blocks that many sequences share (vLLM's PagedAttention,
Kwon et al. 2023; the bookkeeping follows nano-vllm's ``block_manager.py``).

Lesson 1's :class:`~minillm.model.kv_cache.KVCache` reserves a request's whole window up front.
Serving many requests, that wastes memory on windows never filled. The pool instead cuts memory
into blocks of ``block_size`` positions and hands them out as sequences grow; a sequence's *block
table* says where its positions live::

    pool.keys, pool.values   [n_layers, n_kv_heads, num_blocks * block_size, head_dim]  float32
    block table [7, 2, 9]    position p -> slot table[p // block_size] * block_size + p % block_size

    block_size 4:   positions 0-3 -> block 7,  4-7 -> block 2,  8-9 -> block 9 (2 of 4 slots filled)

Reading a sequence's keys gathers its slots in position order, so attention sees exactly the
array a contiguous cache would hold: the logits are the same (tested to 1e-5; in fact equal).

**Prefix caching.** A *full* block is named by a hash chained over its token ids: ``hash(block j)
= H(hash(block j-1), ids in block j)``, so equal hashes mean equal tokens at equal positions from
the very start (keys depend on everything before them). The chain starts from the sequence's
``identity`` (``hash(block -1)``): bytes naming everything else its keys and values depend on
(the model, its weights' precision, the active LoRA adapters and their scales, ...; the runtime's
``kv_identity``), as vLLM mixes a LoRA id into the first block's hash. Sequences of different
identities never share a block, even in one pool. A new sequence whose prompt starts with
blocks already in the pool reuses them: their reference count goes up, no keys are recomputed.
A block whose count falls to 0 stays in the pool, findable by its hash, until a new block is
needed: the free list hands out the least recently freed block first (LRU eviction).

A sequence's own view of the pool (its block table, length and ``KVCache``'s interface) is
:class:`~minillm.model.paged_sequence.PagedSequence`, in ``paged_sequence.py``; every address it
uses is computed here.

The pool is sized in bytes (``kv_cache_mib``): ``num_blocks = floor(MiB * 2**20 / bytes_per_block)``
with ``bytes_per_block = block_size * 2 (k, v) * n_layers * n_kv_heads * head_dim * 4``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from minillm.errors import InvalidRequestError, KVCacheFullError
from minillm.model.config import ModelConfig
from minillm.model.paged_sequence import PagedSequence

MIB = 2**20


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks of ``block_size`` positions needed to hold ``positions`` positions: ``ceil(positions /
    block_size)`` (0 for 0). The one block count of the pool, its planners and its callers."""
    return -(-positions // block_size)


def slots(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Pool slots of ``positions``: ``table[p // block_size] * block_size + p % block_size``, int64.

    ``table`` is one sequence's block table ``[blocks]`` (``positions`` ``[n]`` of it), or one table per
    row ``[g, blocks]`` (``positions`` ``[g]``: one position of each row's sequence). Slot ``s`` is
    position ``s % block_size`` of block ``s // block_size``: the pool's keys are ``[n_blocks *
    block_size]`` slots long (vLLM's ``slot_mapping``).
    """
    blocks = (
        table[positions // block_size] if table.ndim == 1 else table[np.arange(len(table)), positions // block_size]
    )
    return blocks * block_size + positions % block_size


def block_hashes(token_ids, block_size: int, n_blocks: int | None = None, identity: bytes = b"") -> list[bytes]:
    """Chained hashes of the first ``n_blocks`` full blocks of ``token_ids`` (default: all full blocks):
    ``h_j = blake2b(h_{j-1} || ids of block j as int64, digest_size=16)``, ``h_{-1} = identity`` (bytes
    naming what else the keys and values depend on; empty by default). Each hash names a block *and
    everything before it*: two prompts share block ``j``'s keys only if they share blocks ``0..j``."""
    n = len(token_ids) // block_size if n_blocks is None else n_blocks
    ids = np.asarray(token_ids[: n * block_size], dtype=np.int64)
    hashes, prev = [], identity
    for j in range(n):
        prev = hashlib.blake2b(prev + ids[j * block_size : (j + 1) * block_size].tobytes(), digest_size=16).digest()
        hashes.append(prev)
    return hashes


class KVCachePool:
    """Keys and values for many sequences, in ``num_blocks`` blocks of ``block_size`` positions.

    Args:
        num_layers, num_kv_heads, head_dim: the model's KV shape (``for_model`` reads them).
        num_blocks: blocks in the pool (>= 1).
        block_size: positions per block (>= 1; default 16, as vLLM).

    Raises:
        InvalidRequestError: ``block_size`` or ``num_blocks`` below 1.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16):
        check_block_size(block_size)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidRequestError(f"a KV cache pool needs at least 1 block, got num_blocks={num_blocks!r}.")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        self.keys = np.zeros(shape, dtype=np.float32)  # np.zeros: pages are mapped lazily, on first write
        self.values = np.zeros(shape, dtype=np.float32)
        self.ref_count = [0] * num_blocks  # sequences holding each block
        self.block_hash: list[bytes | None] = [None] * num_blocks  # set once a block is full and registered
        self.cached: dict[bytes, int] = {}  # hash -> block id: the prefix cache
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest freed first
        self.hits_tokens = 0  # prompt tokens served from the prefix cache, over the pool's life

    @classmethod
    def for_model(cls, config: ModelConfig, kv_cache_mib: float, block_size: int = 16) -> KVCachePool:
        """A pool of ``kv_cache_mib`` MiB for ``config``'s KV shape: ``floor(MiB * 2**20 / bytes_per_block)`` blocks.

        Raises:
            InvalidRequestError: ``block_size`` < 1, or a size that holds no whole block (the
                message gives one block's size and the smallest ``kv_cache_mib`` that works).
        """
        check_block_size(block_size)
        per_token = config.kv_bytes_per_token()  # the pool holds float32
        per_block = per_token * block_size
        if not (isinstance(kv_cache_mib, (int, float)) and kv_cache_mib > 0):
            raise InvalidRequestError(f"kv_cache_mib must be a positive number of MiB, got {kv_cache_mib!r}.")
        num_blocks = int(kv_cache_mib * MIB // per_block)
        if num_blocks < 1:
            raise InvalidRequestError(
                f"a KV cache pool of {kv_cache_mib:g} MiB holds no block: one block of {block_size} positions "
                f"takes {per_block:,} bytes ({per_block / MIB:.3f} MiB, {per_token:,} bytes per position); "
                f"pass kv_cache_mib >= {per_block / MIB:.3f} or a smaller block_size."
            )
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, num_blocks, block_size)

    # --- sizes -------------------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """``2 * n_layers * n_kv_heads * head_dim * 4``: one position, k and v, every layer (what the
        arrays reserve, per position)."""
        return self.nbytes // (self.num_blocks * self.block_size)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes the pool reserves: ``num_blocks * bytes_per_block``."""
        return self.keys.nbytes + self.values.nbytes

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (some may still carry a cached prefix, evicted when reused)."""
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, positions: int) -> int:
        """Blocks needed to hold ``positions`` positions in this pool (:func:`blocks_for`)."""
        return blocks_for(positions, self.block_size)

    # --- addresses: where a position's key and value live -----------------------------------------
    def slots(self, table: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Pool slots of ``positions`` in this pool (:func:`slots`; shapes there), int64."""
        return slots(table, positions, self.block_size)

    def padded_tables(self, sequences: list[PagedSequence], lengths: np.ndarray) -> np.ndarray:
        """Each sequence's first ``blocks_for(lengths[r])`` blocks, one row per sequence, padded with
        block 0 to the longest: ``[g, max blocks]`` int64 (the padding's keys must be masked)."""
        n_blocks = [self.blocks_for(int(n)) for n in lengths]  # blocks holding positions 0..n-1
        tables = np.zeros((len(sequences), max(n_blocks)), dtype=np.int64)
        for r, (seq, n) in enumerate(zip(sequences, n_blocks, strict=True)):
            tables[r, :n] = seq.block_table[:n]
        return tables

    def write_slots(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k``, ``v`` ``[n_kv_heads, n, head_dim]`` at pool ``slots`` ``[n]`` of ``layer``."""
        self.keys[layer][:, slots] = k
        self.values[layer][:, slots] = v

    def read_slots(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``layer``'s keys and values at pool ``slots`` ``[n]``, in that order: each
        ``[n_kv_heads, n, head_dim]`` (copies: the blocks are scattered in the pool)."""
        return self.keys[layer][:, slots], self.values[layer][:, slots]

    def gather(self, layer: int, tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every row's blocks of ``layer``'s keys and values, by block ``tables`` ``[g, blocks]``:
        each ``[g, n_kv_heads, blocks * block_size, head_dim]`` (a view of one copy).

        Whole blocks are copied by the block table, so no per-position slot index is built.
        ``np.take`` and not ``blocks[:, tables]``: fancy indexing puts the indexed axes first in
        memory and returns a strided view of that, which the reshape would copy a second time
        (``python -m benchmarks.batching`` times the step either way)."""
        return self._gather(self.keys[layer], tables), self._gather(self.values[layer], tables)

    def _gather(self, pooled: np.ndarray, tables: np.ndarray) -> np.ndarray:
        n_kv, _, hd = pooled.shape
        g = tables.shape[0]
        blocks = pooled.reshape(n_kv, self.num_blocks, -1)  # [n_kv_heads, num_blocks, block_size * hd], a view
        gathered = np.take(blocks, tables, axis=1)  # [n_kv_heads, g, blocks, block_size * head_dim]: one copy
        return gathered.reshape(n_kv, g, -1, hd).transpose(1, 0, 2, 3)  # [g, n_kv_heads, ctx, head_dim], a view

    def sequence(self, max_seq_len: int, identity: bytes = b"") -> PagedSequence:
        """A new, empty sequence of at most ``max_seq_len`` positions, holding no block yet; its
        blocks are named under ``identity`` (see :meth:`block_hashes`)."""
        return PagedSequence(self, max_seq_len, identity)

    # --- prefix caching ------------------------------------------------------------------------------
    def block_hashes(self, token_ids, n_blocks: int | None = None, identity: bytes = b"") -> list[bytes]:
        """Chained hashes of the first ``n_blocks`` full blocks of ``token_ids`` in this pool's blocks
        (:func:`block_hashes`)."""
        return block_hashes(token_ids, self.block_size, n_blocks, identity)

    def cached_prefix(self, token_ids, identity: bytes = b"") -> list[int]:
        """The blocks holding the longest cached prefix of ``token_ids`` computed under ``identity``,
        in order. At least the last token is left out, so a sequence always computes one position
        (its logits are needed)."""
        found = []
        for h in self.block_hashes(token_ids, (len(token_ids) - 1) // self.block_size, identity):
            block = self.cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, token_ids, identity: bytes = b"") -> bool:
        """True if the pool can hold every position of ``token_ids`` now (the cached prefix computed
        under ``identity`` reused)."""
        prefix = self.cached_prefix(token_ids, identity)
        held = sum(1 for b in prefix if self.ref_count[b] > 0)  # reused without taking a free block
        return self.blocks_for(len(token_ids)) - held <= len(self.free_blocks)

    def allocate(self, seq: PagedSequence, token_ids) -> int:
        """Give ``seq`` (empty) blocks for every position of ``token_ids``: the cached prefix's
        blocks computed under ``seq.identity`` (shared), then fresh ones. Sets ``seq.length`` to
        the cached positions and returns that number (whole blocks), the prompt tokens that need no
        computing.

        Raises:
            KVCacheFullError: not enough free blocks (check :meth:`can_allocate` first).
        """
        if seq.block_table:
            raise InvalidRequestError("allocate() needs an empty sequence; reset() it first.")
        if not self.can_allocate(token_ids, seq.identity):
            raise self._full(self.blocks_for(len(token_ids)))
        prefix = self.cached_prefix(token_ids, seq.identity)
        for block in prefix:
            self.free_blocks.pop(block, None)  # an unreferenced cached block is taken back from the free list
            self.ref_count[block] += 1
        seq.block_table = list(prefix)
        seq.hashes = [self.block_hash[b] for b in prefix]
        seq.length = seq.cached_tokens = len(prefix) * self.block_size
        self.hits_tokens += seq.cached_tokens
        self.grow(seq, len(token_ids) - seq.length)
        return seq.cached_tokens

    def can_grow(self, seq: PagedSequence, n: int) -> bool:
        """True if ``seq`` can take ``n`` more positions (new blocks only where its last one is full)."""
        return self.blocks_for(seq.length + n) - len(seq.block_table) <= len(self.free_blocks)

    def grow(self, seq: PagedSequence, n: int) -> None:
        """Add blocks to ``seq`` so positions up to ``seq.length + n - 1`` have a slot.

        Raises:
            KVCacheFullError: not enough free blocks (the scheduler preempts before this happens).
        """
        need = self.blocks_for(seq.length + n) - len(seq.block_table)
        if need > len(self.free_blocks):
            raise self._full(need)
        for _ in range(need):
            seq.block_table.append(self._fresh_block())

    def _fresh_block(self) -> int:
        """Take the least recently freed block (LRU eviction: its cached prefix is forgotten), count 1."""
        block, _ = self.free_blocks.popitem(last=False)
        self._unname(block)
        self.ref_count[block] = 1
        return block

    def _unname(self, block: int) -> None:
        """Take ``block`` out of the prefix cache (its contents are about to change)."""
        if self.block_hash[block] is not None:
            if self.cached.get(self.block_hash[block]) == block:
                del self.cached[self.block_hash[block]]
            self.block_hash[block] = None

    def truncate(self, seq: PagedSequence, length: int) -> None:
        """Forget ``seq``'s positions ``length..`` (speculative decoding's rejected drafts): whole
        tail blocks go back to the pool; the next write starts at ``length``.

        A tail block that is partly kept will be overwritten from ``length % block_size`` on. If the
        prefix cache names it, the name is dropped; if another sequence shares it (prefix caching),
        ``seq`` gets a private copy of the kept positions instead (copy on write), so the other
        sequence's keys are never touched.

        Raises:
            InvalidRequestError: ``length`` outside ``0..seq.length``.
            KVCacheFullError: a shared block must be copied and no block is free.
        """
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= seq.length:
            raise InvalidRequestError(f"cannot truncate a sequence of length {seq.length} to {length!r}.")
        keep = self.blocks_for(length)
        for block in reversed(seq.block_table[keep:]):  # tail first: freed newest last, as release
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks[block] = None
        del seq.block_table[keep:]
        del seq.hashes[length // self.block_size :]  # blocks no longer full lose their names
        if length % self.block_size:  # the last kept block is partly overwritten from here on
            block = seq.block_table[-1]
            if self.ref_count[block] > 1:  # shared: copy the kept positions into a block of our own
                if not self.free_blocks:
                    raise self._full(1)
                fresh, bs = self._fresh_block(), self.block_size
                for store in (self.keys, self.values):  # [n_layers, n_kv_heads, slots, head_dim]
                    store[:, :, fresh * bs : fresh * bs + length % bs] = store[
                        :, :, block * bs : block * bs + length % bs
                    ]
                self.ref_count[block] -= 1
                seq.block_table[-1] = fresh
            else:
                self._unname(block)
        seq.length = length
        seq._slots = np.zeros(0, dtype=np.int64)

    def register_full_blocks(self, seq: PagedSequence, token_ids) -> None:
        """Enter ``seq``'s newly filled blocks into the prefix cache; ``token_ids`` are the
        sequence's ids, of which the first ``seq.length`` are in the cache."""
        full = seq.length // self.block_size
        if full <= len(seq.hashes):
            return
        bs, prev = self.block_size, seq.hashes[-1] if seq.hashes else seq.identity
        ids = np.asarray(token_ids[: full * bs], dtype=np.int64)
        for j in range(len(seq.hashes), full):
            prev = hashlib.blake2b(prev + ids[j * bs : (j + 1) * bs].tobytes(), digest_size=16).digest()
            seq.hashes.append(prev)
            block = seq.block_table[j]
            self.block_hash[block] = prev
            self.cached.setdefault(prev, block)  # a second copy of the same prefix stays unnamed

    def release(self, seq: PagedSequence) -> None:
        """Return ``seq``'s blocks: each count drops by one; a block no one holds joins the free list
        (newest last, and a sequence's tail before its head, so shared prefixes are evicted last)."""
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks[block] = None
        seq.block_table, seq.hashes, seq.length = [], [], 0
        seq._slots = np.zeros(0, dtype=np.int64)

    def _full(self, need: int) -> KVCacheFullError:
        return KVCacheFullError(
            f"the KV cache pool has {len(self.free_blocks)} free blocks of {self.num_blocks} "
            f"({self.block_size} positions each) and {need} more were asked for; raise kv_cache_mib, "
            "or let the scheduler wait or preempt (it checks before allocating)."
        )

    def __repr__(self) -> str:
        return (
            f"KVCachePool(blocks={self.num_used_blocks}/{self.num_blocks} used, block_size={self.block_size}, "
            f"cached prefixes={len(self.cached)}, nbytes={self.nbytes:,})"
        )


def check_block_size(block_size) -> None:
    """Raise :class:`InvalidRequestError` unless ``block_size`` is a whole number >= 1."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidRequestError(
            f"block_size must be a whole number of positions >= 1, got {block_size!r}; vLLM and minillm use 16."
        )
