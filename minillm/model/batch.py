"""Attention for a batch of sequences in one forward pass (``Transformer.forward_batch``).

Every projection takes the rows of all sequences at once; attention cannot: each row must see only
its own sequence's keys and values, under its own causal mask. :class:`BatchAttention` splits the
rows by sequence. Decode rows whose keys live in one paged pool are attended together
(:class:`DecodeRows`: keys gathered from each row's blocks, padded to the longest context, each
row's own mask hiding the padding); any other sequence goes through the one-sequence path
(:class:`SequenceAttention`), exactly as ``Transformer.forward`` runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from minillm.errors import InvalidRequestError
from minillm.model import primitives
from minillm.model.families import LayerType

if TYPE_CHECKING:  # transformer.py imports this module; the types only are needed here
    from minillm.model.kv_cache import KVCache
    from minillm.model.transformer import Hook, Transformer
    from minillm.model.weights import LayerWeights


class BatchAttention:
    """Attention for a batch: sequence ``j`` owns rows ``bounds[j]:bounds[j+1]`` of ``qkv`` and attends
    over its own cache with its own mask, so no row ever sees another sequence's keys.

    Decode rows (one row, a paged cache) are attended all at once (:class:`DecodeRows`); prefill
    chunks and contiguous caches one sequence at a time (:class:`SequenceAttention`). Intermediates
    are not captured here (``forward`` captures one sequence).
    """

    def __init__(self, sequences: list[SequenceAttention], bounds: np.ndarray):
        self.model = sequences[0].model
        one_row = [j for j, s in enumerate(sequences) if bounds[j + 1] - bounds[j] == 1]
        pool = _paged_pool(sequences[one_row[0]].cache) if one_row else None
        grouped = [j for j in one_row if pool is not None and _paged_pool(sequences[j].cache) is pool]
        self.decode = (
            DecodeRows(self.model, [sequences[j].cache for j in grouped], bounds[grouped]) if grouped else None
        )
        alone = sorted(set(range(len(sequences))) - set(grouped))
        self.alone = [(sequences[j], bounds[j], bounds[j + 1]) for j in alone]

    def __call__(self, i: int, layer: LayerWeights, qkv: np.ndarray, hook: Hook | None = None) -> np.ndarray:
        z = np.empty((qkv.shape[0], self.model.config.q_dim), dtype=np.float32)  # [rows, q_dim]
        if self.decode is not None:
            z[self.decode.rows] = self.decode(i, layer, qkv[self.decode.rows])
        for sequence, a, b in self.alone:
            z[a:b] = sequence(i, layer, qkv[a:b])
        return z


class DecodeRows:
    """One decode row each for ``g`` sequences of one paged pool, attended together in every layer.

    The same steps as :meth:`Transformer.attention`, with the sequences as a leading axis: QK-norm,
    RoPE at each row's own position, k and v written to each row's slot, then every row's keys
    gathered from the pool block by block, padded to the longest block table (``ctx`` = its blocks x
    ``block_size``); each row's mask (``causal_mask`` at
    its own offset) hides the padding, so ``primitives.attention`` computes what it computes for the
    row alone. One set of NumPy calls per layer instead of one per sequence.
    """

    def __init__(self, model: Transformer, caches: list, rows: np.ndarray):
        self.model, self.caches, self.rows = model, caches, np.asarray(rows)
        self.pool = _paged_pool(caches[0])
        bs = self.pool.block_size
        positions = np.array([c.length for c in caches])  # [g]: each row's absolute position
        n_blocks = [-(-(int(p) + 1) // bs) for p in positions]  # blocks holding positions 0..p
        ctx = max(n_blocks) * bs  # keys gathered per row: whole blocks, padded to the longest table
        self.tables = np.zeros((len(caches), max(n_blocks)), dtype=np.int64)  # [g, blocks]; padding: block 0
        for r, (cache, n) in enumerate(zip(caches, n_blocks, strict=True)):
            self.tables[r, :n] = cache.block_table[:n]
        table = self.tables[np.arange(len(caches)), positions // bs]  # [g]: the block of each new key
        self.new_slots = table * bs + positions % bs  # [g]: pool slot of each row's new key
        self.rope = {t: model.rope(positions, t) for t in model.inv_freq}  # (cos, sin) [g, head_dim]
        self.masks = {  # layer type -> [g, 1, 1, ctx]: each row's own mask at its own offset
            t: np.stack([_padded(model, t, int(p), ctx) for p in positions])[:, None, None, :]
            for t in model.masks(1, 0)
        }

    def __call__(self, i: int, layer: LayerWeights, qkv: np.ndarray) -> np.ndarray:
        cfg = self.model.config
        g = qkv.shape[0]
        n_heads, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = qkv[:, : cfg.q_dim].reshape(g, n_heads, 1, hd)  # [g, n_heads, 1, head_dim]
        k = qkv[:, cfg.q_dim : -cfg.kv_dim].reshape(g, n_kv, 1, hd)  # [g, n_kv_heads, 1, head_dim]
        v = qkv[:, -cfg.kv_dim :].reshape(g, n_kv, 1, hd)
        if cfg.qk_norm:
            q = primitives.rms_norm(q, layer.q_norm, cfg.norm_eps)
            k = primitives.rms_norm(k, layer.k_norm, cfg.norm_eps)
        layer_type = self.model.layer_types[i]
        if layer_type in self.rope:
            cos, sin = (t[:, None, None, :] for t in self.rope[layer_type])  # [g, 1, 1, head_dim]
            q = primitives.apply_rope(q, cos, sin)
            k = primitives.apply_rope(k, cos, sin)
        keys, values = self.pool.keys[i], self.pool.values[i]  # [n_kv_heads, slots, head_dim]
        keys[:, self.new_slots] = k[:, :, 0].transpose(1, 0, 2)  # each row's key at its own slot
        values[:, self.new_slots] = v[:, :, 0].transpose(1, 0, 2)
        k_all, v_all = (self._gather(a) for a in (keys, values))  # [g, n_kv_heads, ctx, head_dim] each
        z, _ = primitives.attention(q, k_all, v_all, self.masks[layer_type], cfg.attn_scale)  # [g, n_heads, 1, hd]
        return z.reshape(g, cfg.q_dim)

    def _gather(self, pooled: np.ndarray) -> np.ndarray:
        """Every row's blocks of one layer's ``pooled`` keys or values ``[n_kv_heads, slots, head_dim]``
        -> ``[g, n_kv_heads, ctx, head_dim]`` (a view of one copy). Whole blocks are copied by the
        block table, so no per-position slot index is built; the copy itself is bound by memory
        (32 rows of 80 positions: about 0.1 ms per layer for keys, as many for values). ``np.take``
        and not ``blocks[:, tables]``: fancy indexing puts the indexed axes first in memory and
        returns a strided view of that, which the reshape below would copy a second time
        (32 rows, one step: 11.5 -> 5.2 ms)."""
        n_kv, _, hd = pooled.shape
        g, n_blocks = self.tables.shape
        blocks = pooled.reshape(n_kv, self.pool.num_blocks, -1)  # [n_kv_heads, num_blocks, block_size * hd], a view
        gathered = np.take(blocks, self.tables, axis=1)  # [n_kv_heads, g, blocks, block_size * head_dim]: one copy
        return gathered.reshape(n_kv, g, -1, hd).transpose(1, 0, 2, 3)  # [g, n_kv_heads, ctx, head_dim], a view


def _padded(model: Transformer, layer_type: LayerType, position: int, ctx: int) -> np.ndarray:
    """Row ``position``'s mask ``[ctx]``, keys beyond it hidden (they are another row's padding)."""
    row = np.full(ctx, -np.inf, dtype=np.float32)
    row[: position + 1] = model.masks(1, position)[layer_type][0]
    return row


def _paged_pool(cache):
    """The pool of a paged sequence (``paged_kv_cache.PagedSequence``), None for a contiguous cache."""
    return getattr(cache, "pool", None)


def forward_batch(
    model: Transformer,
    chunks: Sequence[tuple[np.ndarray, KVCache]],
    *,
    all_logits: bool = False,
    last_rows: Sequence[int] | None = None,
) -> np.ndarray:
    """Run several sequences in one pass: each ``(token_ids, cache)`` feeds ``token_ids`` at
    positions ``cache.length..`` of its own cache (a decode row is one id, a prefill chunk many).

    The rows of every sequence are stacked into one ``[rows, d_model]`` matrix, so each
    projection reads its weights once for the whole batch (``[rows, d_model] @ W.T``); that is
    what batching buys, as the weights dominate a decode step's memory traffic. Attention alone
    runs per sequence, over that sequence's own cached keys and values with its own causal mask
    (:class:`BatchAttention`): rows of different sequences never see each other. Each row gets
    the same numbers as :meth:`Transformer.forward` on that sequence alone, up to float32 rounding of the
    products (BLAS sums a matrix product in another order than a matrix-vector product).

    Args:
        chunks: ``(token_ids [seq_j] int, cache)`` per sequence; ``cache`` is a :class:`KVCache`
            or anything with its interface (a paged cache's sequence, ``paged_kv_cache.py``).
            Each cache is written at ``cache.length..+seq_j`` and advanced by ``seq_j``.
        all_logits: return logits for every row (tests, lessons) instead of the last row of
            each sequence (what sampling needs; saves the LM head's work on prefill rows).
        last_rows: how many of each sequence's last rows get logits (default 1 each); speculative
            decoding verifies ``k`` drafted tokens with the logits of a chunk's last ``k + 1`` rows.

    Returns:
        float32 logits ``[n_sequences, vocab]`` (the last row of each chunk), or
        ``[rows, vocab]`` with ``all_logits`` (rows in the order of ``chunks``), or
        ``[sum(last_rows), vocab]`` with ``last_rows``.

    Raises:
        InvalidRequestError: no chunks, or a chunk without tokens.
        KVCacheFullError / KVCacheMismatchError: as :meth:`Transformer.forward`, for any sequence.
    """
    if not chunks:
        raise InvalidRequestError("forward_batch got no sequences; pass at least one (token_ids, cache) pair.")
    ids = [np.asarray(t, dtype=np.int64).reshape(-1) for t, _ in chunks]
    sequences, positions = [], []
    for j, (token_ids, (_, cache)) in enumerate(zip(ids, chunks, strict=True)):
        if len(token_ids) == 0:
            raise InvalidRequestError(f"forward_batch: sequence {j} has no tokens; feed at least one per sequence.")
        cache.check_compatible(model.config)
        cache.check_room(len(token_ids))
        positions.append(np.arange(cache.length, cache.length + len(token_ids)))  # [seq_j]
        sequences.append(SequenceAttention(model, positions[-1], cache))
    bounds = np.cumsum([0] + [len(t) for t in ids])  # sequence j owns rows bounds[j]:bounds[j+1]
    attend = BatchAttention(sequences, bounds)

    batched = primitives.BATCHED.set(True)  # products with few rows take few_rows_product
    try:
        x = model.embed(np.concatenate(ids), np.concatenate(positions))  # [rows, d_model]
        for i, layer in enumerate(model.weights.layers):
            x = model.decoder_layer(i, x, layer, attend)
        for token_ids, (_, cache) in zip(ids, chunks, strict=True):
            cache.advance(len(token_ids))
        if last_rows is not None:  # [sum(last_rows), d_model]: each sequence's last rows, in order
            x = x[np.concatenate([np.arange(b - m, b) for b, m in zip(bounds[1:], last_rows, strict=True)])]
        elif not all_logits:
            x = x[bounds[1:] - 1]  # [n_sequences, d_model]: each sequence's last row
        return model.head(x)
    finally:
        primitives.BATCHED.reset(batched)


class SequenceAttention:
    """The per-sequence part of attention for one forward pass: this sequence's RoPE angles and masks
    (from its positions) and its KV cache. Called once per layer: ``attend(i, layer, qkv, hook) -> z``.
    """

    def __init__(self, model: Transformer, positions: np.ndarray, cache: KVCache | None):
        self.model, self.cache = model, cache
        self.rope = {t: model.rope(positions, t) for t in model.inv_freq}  # layer type -> (cos, sin) [seq, head_dim]
        self.masks = model.masks(len(positions), int(positions[0]))  # layer type -> [seq, ctx]

    def __call__(self, i: int, layer: LayerWeights, qkv: np.ndarray, hook: Hook | None = None) -> np.ndarray:
        layer_type = self.model.layer_types[i]
        return self.model.attention(i, layer, qkv, self.rope.get(layer_type), self.masks[layer_type], self.cache, hook)
