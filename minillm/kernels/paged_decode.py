"""A batch's decode rows over one paged pool, attended together: one set of NumPy calls per layer.

The textbook attends every sequence of a batch alone (``model/batch.py``): for ``g`` decode rows,
``g`` small attentions per layer, each gathering its keys from the pool. :class:`DecodeRows` does
the same steps with the sequences as a leading axis, and :class:`GroupedAttention` routes a
batch's one-row chunks of one pool to it (the rest still alone). The pool's address math (slots,
padded block tables, the gather) is ``paged_kv_cache.KVCachePool``'s.
"""

from __future__ import annotations

import numpy as np

from minillm.model import primitives
from minillm.model.batch import Attend, BatchAttention
from minillm.model.families import LayerType
from minillm.model.positions import PositionTables
from minillm.model.transformer import Transformer
from minillm.model.weights import LayerWeights


class GroupedAttention(BatchAttention):
    """``BatchAttention`` with the decode rows (one row, a paged cache) of one pool attended all at
    once (:class:`DecodeRows`); prefill chunks and contiguous caches one sequence at a time."""

    def __init__(self, model: Transformer, sequences: list[Attend], caches: list, bounds: np.ndarray):
        one_row = [j for j in range(len(sequences)) if bounds[j + 1] - bounds[j] == 1]
        pool = _paged_pool(caches[one_row[0]]) if one_row else None
        grouped = [j for j in one_row if pool is not None and _paged_pool(caches[j]) is pool]
        super().__init__(model.config.q_dim, sequences, bounds, skip=set(grouped))
        self.decode = DecodeRows(model, [caches[j] for j in grouped], bounds[grouped]) if grouped else None

    def __call__(self, i: int, layer: LayerWeights, qkv: np.ndarray, hook=None) -> np.ndarray:
        z = np.empty((qkv.shape[0], self.q_dim), dtype=np.float32)  # [rows, q_dim]
        if self.decode is not None:
            z[self.decode.rows] = self.decode(i, layer, qkv[self.decode.rows])
        self.attend_alone(i, layer, qkv, z)
        return z


class DecodeRows:
    """One decode row each for ``g`` sequences of one paged pool, attended together in every layer.

    The same steps as ``Transformer.attention``, with the sequences as a leading axis: QK-norm and
    RoPE at each row's own position (``Transformer.rotate``), k and v written to each row's slot,
    then every row's keys gathered from the pool block by block, padded to the longest block table
    (``ctx`` = its blocks x ``block_size``); each row's mask (``causal_mask`` at its own offset) hides
    the padding, so ``primitives.attention`` computes what it computes for the row alone.
    """

    def __init__(self, model: Transformer, caches: list, rows: np.ndarray):
        self.model, self.config, per_position = model, model.config, model.positions
        self.layer_types = per_position.layer_types
        self.caches, self.rows = caches, np.asarray(rows)
        self.pool = _paged_pool(caches[0])
        positions = np.array([c.length for c in caches])  # [g]: each row's absolute position
        self.tables = self.pool.padded_tables(caches, positions + 1)  # [g, blocks]: blocks holding 0..p
        ctx = self.tables.shape[1] * self.pool.block_size  # keys gathered per row, padded to the longest
        self.new_slots = self.pool.slots(self.tables, positions)  # [g]: pool slot of each row's new key
        self.rope = {  # layer type -> (cos, sin) [g, 1, 1, head_dim]
            t: tuple(a[:, None, None, :] for a in per_position.rope(positions, t)) for t in per_position.inv_freq
        }
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
        layer_type = self.layer_types[i]
        q, k = self.model.rotate(layer, q, k, self.rope.get(layer_type))
        # each row's key and value at its own slot: [n_kv_heads, g, head_dim]
        self.pool.write_slots(i, self.new_slots, k[:, :, 0].transpose(1, 0, 2), v[:, :, 0].transpose(1, 0, 2))
        k_all, v_all = self.pool.gather(i, self.tables)  # [g, n_kv_heads, ctx, head_dim] each
        z, _ = primitives.attention(q, k_all, v_all, self.masks[layer_type], cfg.attn_scale)  # [g, n_heads, 1, hd]
        return z.reshape(g, cfg.q_dim)


def _padded(per_position: PositionTables, layer_type: LayerType, position: int, ctx: int) -> np.ndarray:
    """Row ``position``'s mask ``[ctx]``, keys beyond it hidden (they are another row's padding)."""
    row = np.full(ctx, -np.inf, dtype=np.float32)
    row[: position + 1] = per_position.masks(1, position)[layer_type][0]
    return row


def _paged_pool(cache):
    """The pool of a paged sequence (``paged_kv_cache.PagedSequence``), None for a contiguous cache."""
    return getattr(cache, "pool", None)
