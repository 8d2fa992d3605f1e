"""A batch's decode rows over one paged pool, attended together: one set of NumPy calls per layer.

The textbook's pass attends every sequence of a batch alone (``model/passes.py``): for ``g`` decode
rows, ``g`` small attentions per layer, each gathering its keys from the pool. :class:`DecodeRows`
does the same steps with the sequences as a leading axis (``TunedPass`` in ``tuned.py`` routes a
batch's one-row chunks of one pool to it; the rest still alone). The pool's address math (slots,
padded block tables, the gather) is ``paged_kv_cache.KVCachePool``'s.
"""

from __future__ import annotations

import numpy as np

from minillm.model import primitives
from minillm.model.config import ModelConfig
from minillm.model.families import LayerType
from minillm.model.paged_sequence import PagedSequence
from minillm.model.positions import PositionTables


class DecodeRows:
    """One decode row each for ``g`` sequences of one paged pool, attended together in every layer.

    The same steps as ``passes.ForwardPass.attend_sequence``, with the sequences as a leading axis:
    QK-norm and RoPE at each row's own position (``primitives.qk_norm_rope``), k and v written to
    each row's slot, then every row's keys gathered from the pool block by block, padded to the
    longest block table (``ctx`` = its blocks x ``block_size``); each row's mask (``causal_mask`` at
    its own offset) hides the padding, so ``primitives.attention`` computes what it computes for the
    row alone. ``caches``: the rows' :class:`PagedSequence` (one pool), ``rows``: their rows in the pass.
    """

    def __init__(self, config: ModelConfig, tables: PositionTables, caches: list[PagedSequence], rows: np.ndarray):
        self.config, self.layer_types = config, tables.layer_types
        self.caches, self.rows = caches, np.asarray(rows)
        self.pool = caches[0].pool
        positions = np.array([c.length for c in caches])  # [g]: each row's absolute position
        self.tables = self.pool.padded_tables(caches, positions + 1)  # [g, blocks]: blocks holding 0..p
        ctx = self.tables.shape[1] * self.pool.block_size  # keys gathered per row, padded to the longest
        self.new_slots = self.pool.slots(self.tables, positions)  # [g]: pool slot of each row's new key
        self.rope = {  # layer type -> (cos, sin) [g, 1, 1, head_dim]
            t: tuple(a[:, None, None, :] for a in tables.rope(positions, t)) for t in tables.inv_freq
        }
        self.masks = {  # layer type -> [g, 1, 1, ctx]: each row's own mask at its own offset
            t: np.stack([_padded(tables, t, int(p), ctx) for p in positions])[:, None, None, :]
            for t in tables.masks(1, 0)
        }

    def __call__(self, i: int, qkv: np.ndarray, q_norm=None, k_norm=None) -> np.ndarray:
        """Layer ``i``'s attention of the ``g`` rows: ``qkv`` ``[g, q_dim + 2 kv_dim]`` -> ``z`` ``[g, q_dim]``."""
        cfg = self.config
        g = qkv.shape[0]
        n_heads, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = qkv[:, : cfg.q_dim].reshape(g, n_heads, 1, hd)  # [g, n_heads, 1, head_dim]
        k = qkv[:, cfg.q_dim : -cfg.kv_dim].reshape(g, n_kv, 1, hd)  # [g, n_kv_heads, 1, head_dim]
        v = qkv[:, -cfg.kv_dim :].reshape(g, n_kv, 1, hd)
        layer_type = self.layer_types[i]
        q, k = primitives.qk_norm_rope(q, k, q_norm, k_norm, cfg.norm_eps, self.rope.get(layer_type))
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
