"""Attention for a batch of sequences in one forward pass (``Transformer.forward_batch``).

Every projection takes the rows of all sequences at once; attention cannot: each row must see only
its own sequence's keys and values, under its own causal mask. :class:`BatchAttention` splits the
rows by sequence. Decode rows whose keys live in one paged pool are attended together
(:class:`DecodeRows`: keys gathered from each row's blocks, padded to the longest context, each
row's own mask hiding the padding); any other sequence goes through the one-sequence path
(``transformer.SequenceAttention``), exactly as ``Transformer.forward`` runs it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minillm.model import primitives
from minillm.model.config import ModelConfig
from minillm.model.families import LayerType
from minillm.model.positions import PositionTables
from minillm.model.weights import LayerWeights

#: ``attend(i, layer, qkv, hook) -> z``: the per-sequence part of attention in layer ``i``, ``qkv``
#: ``[seq, q_dim + 2 kv_dim]`` -> ``z`` ``[seq, q_dim]`` (``transformer.SequenceAttention``, :class:`BatchAttention`).
Attend = Callable[..., np.ndarray]


class BatchAttention:
    """Attention for a batch: sequence ``j`` owns rows ``bounds[j]:bounds[j+1]`` of ``qkv`` and attends
    over its own cache with its own mask, so no row ever sees another sequence's keys.

    Decode rows (one row, a paged cache) are attended all at once (:class:`DecodeRows`); prefill
    chunks and contiguous caches one sequence at a time (``sequences[j]``, a
    ``transformer.SequenceAttention`` over ``caches[j]``). Intermediates
    are not captured here (``forward`` captures one sequence).
    """

    def __init__(
        self, config: ModelConfig, per_position: PositionTables, sequences: list[Attend], caches: list, bounds
    ):
        self.config = config
        one_row = [j for j in range(len(sequences)) if bounds[j + 1] - bounds[j] == 1]
        pool = _paged_pool(caches[one_row[0]]) if one_row else None
        grouped = [j for j in one_row if pool is not None and _paged_pool(caches[j]) is pool]
        self.decode = (
            DecodeRows(config, per_position, [caches[j] for j in grouped], bounds[grouped]) if grouped else None
        )
        alone = sorted(set(range(len(sequences))) - set(grouped))
        self.alone = [(sequences[j], bounds[j], bounds[j + 1]) for j in alone]

    def __call__(self, i: int, layer: LayerWeights, qkv: np.ndarray, hook: Callable | None = None) -> np.ndarray:
        z = np.empty((qkv.shape[0], self.config.q_dim), dtype=np.float32)  # [rows, q_dim]
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

    def __init__(self, config: ModelConfig, per_position: PositionTables, caches: list, rows: np.ndarray):
        self.config, self.layer_types = config, per_position.layer_types
        self.caches, self.rows = caches, np.asarray(rows)
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
        self.rope = {t: per_position.rope(positions, t) for t in per_position.inv_freq}  # (cos, sin) [g, head_dim]
        self.masks = {  # layer type -> [g, 1, 1, ctx]: each row's own mask at its own offset
            t: np.stack([_padded(per_position, t, int(p), ctx) for p in positions])[:, None, None, :]
            for t in per_position.masks(1, 0)
        }

    def __call__(self, i: int, layer: LayerWeights, qkv: np.ndarray) -> np.ndarray:
        cfg = self.config
        g = qkv.shape[0]
        n_heads, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = qkv[:, : cfg.q_dim].reshape(g, n_heads, 1, hd)  # [g, n_heads, 1, head_dim]
        k = qkv[:, cfg.q_dim : -cfg.kv_dim].reshape(g, n_kv, 1, hd)  # [g, n_kv_heads, 1, head_dim]
        v = qkv[:, -cfg.kv_dim :].reshape(g, n_kv, 1, hd)
        if cfg.qk_norm:
            q = primitives.rms_norm(q, layer.q_norm, cfg.norm_eps)
            k = primitives.rms_norm(k, layer.k_norm, cfg.norm_eps)
        layer_type = self.layer_types[i]
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
        block table, so no per-position slot index is built; the copy itself is bound by memory.
        ``np.take`` and not ``blocks[:, tables]``: fancy indexing puts the indexed axes first in
        memory and returns a strided view of that, which the reshape below would copy a second time
        (the step time of both: ``python -m benchmarks.batching``, README's batching section)."""
        n_kv, _, hd = pooled.shape
        g, n_blocks = self.tables.shape
        blocks = pooled.reshape(n_kv, self.pool.num_blocks, -1)  # [n_kv_heads, num_blocks, block_size * hd], a view
        gathered = np.take(blocks, self.tables, axis=1)  # [n_kv_heads, g, blocks, block_size * head_dim]: one copy
        return gathered.reshape(n_kv, g, -1, hd).transpose(1, 0, 2, 3)  # [g, n_kv_heads, ctx, head_dim], a view


def _padded(per_position: PositionTables, layer_type: LayerType, position: int, ctx: int) -> np.ndarray:
    """Row ``position``'s mask ``[ctx]``, keys beyond it hidden (they are another row's padding)."""
    row = np.full(ctx, -np.inf, dtype=np.float32)
    row[: position + 1] = per_position.masks(1, position)[layer_type][0]
    return row


def _paged_pool(cache):
    """The pool of a paged sequence (``paged_kv_cache.PagedSequence``), None for a contiguous cache."""
    return getattr(cache, "pool", None)
