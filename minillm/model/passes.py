"""One forward pass's rows: what ``Kernels.begin`` returns and the layers call (``transformer.py``).

A pass knows its rows, once: which sequence owns which rows (chunk ``j`` owns rows
``bounds[j]:bounds[j+1]``), each sequence's positions, RoPE angles, masks and KV cache, whether the
rows are one sequence's or a batch's, and whether intermediates are captured. The layers hand it
arrays and held matrices only:

    fwd.linear(x, w, b)             a projection over every row at once: x @ w.T (+ b)
    fwd.attend(i, qkv, q_norm, k_norm)   layer i's attention, each sequence over its own keys
    fwd.finish()                    the caches moved on by the rows fed

Every projection takes the rows of all sequences at once (one read of each weight for the whole
batch); attention cannot: each row must see only its own sequence's keys and values, under its own
causal mask, so :meth:`ForwardPass.attend` runs one sequence at a time through the textbook's steps
(``primitives.split_heads``, ``primitives.qk_norm_rope``, the cache's ``write``, attention,
``primitives.merge_heads``). The engine room's pass (``minillm/kernels/tuned.py``) attends a batch's
decode rows over one paged pool together instead, and takes its few-rows products for a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minillm.model import primitives
from minillm.model.config import ModelConfig
from minillm.model.held import HeldMatrix
from minillm.model.positions import PositionTables


class ForwardPass:
    """The plain pass: the kernels' products and attention, one sequence's attention at a time.

    Args:
        kernels: the model's (prepared) kernels, whose ``linear`` and ``attention`` it calls.
        config: the model's config (heads, ``head_dim``, ``norm_eps``, ``attn_scale``).
        tables: the model's RoPE angles and masks per layer type (``positions.py``).
        chunks: ``(positions [seq_j] int, cache or None)`` per sequence, in row order.
        batch: the rows are a batch's (``forward_batch``): a tuned pass may take few-rows products.
        capture: a dict to store intermediates in (TransformerLens names), or None.
    """

    def __init__(
        self,
        kernels,
        config: ModelConfig,
        tables: PositionTables,
        chunks: Sequence[tuple[np.ndarray, object]],
        *,
        batch: bool = False,
        capture: dict | None = None,
    ):
        self.kernels, self.config, self.batch, self.capture = kernels, config, batch, capture
        self.layer_types = tables.layer_types
        self.caches = [cache for _, cache in chunks]
        self.bounds = np.cumsum([0] + [len(positions) for positions, _ in chunks])  # chunk j: bounds[j]:bounds[j+1]
        self.rope = [{t: tables.rope(p, t) for t in tables.inv_freq} for p, _ in chunks]  # type -> (cos, sin)
        self.masks = [tables.masks(len(p), int(p[0]), kernels) for p, _ in chunks]  # type -> [seq_j, ctx_j]
        self.alone = list(range(len(chunks)))  # the sequences attended one at a time (all, here)

    def linear(self, x: np.ndarray, w: HeldMatrix, b: np.ndarray | None = None) -> np.ndarray:
        """``x @ w.T (+ b)`` over the pass's rows: ``x`` float32 ``[rows, in]`` -> ``[rows, out]``
        (``Kernels.linear``)."""
        return self.kernels.linear(x, w, b)

    def attend(self, i: int, qkv: np.ndarray, q_norm=None, k_norm=None) -> np.ndarray:
        """Layer ``i``'s attention: ``qkv`` ``[rows, q_dim + 2 kv_dim]`` -> ``z`` ``[rows, q_dim]``,
        each sequence's rows over its own cache (written at layer ``i``) with its own mask.
        ``q_norm``, ``k_norm``: ``[head_dim]`` QK-norm weights (Qwen 3, Gemma 3), None without."""
        if len(self.caches) == 1:
            return self.attend_sequence(0, i, qkv, q_norm, k_norm)
        z = np.empty((qkv.shape[0], self.config.q_dim), dtype=np.float32)  # [rows, q_dim]
        self.attend_alone(i, qkv, q_norm, k_norm, z)
        return z

    def attend_alone(self, i: int, qkv: np.ndarray, q_norm, k_norm, z: np.ndarray) -> None:
        """Each sequence of :attr:`alone`'s rows of ``z`` ``[rows, q_dim]``, one sequence at a time."""
        for j in self.alone:
            a, b = self.bounds[j], self.bounds[j + 1]
            z[a:b] = self.attend_sequence(j, i, qkv[a:b], q_norm, k_norm)

    def attend_sequence(self, j: int, i: int, qkv: np.ndarray, q_norm, k_norm) -> np.ndarray:
        """Sequence ``j``'s attention in layer ``i`` (Vaswani et al. 2017): ``qkv`` ``[seq, q_dim +
        2 kv_dim]`` -> ``z`` ``[seq, q_dim]``. QK-norm and RoPE on q and k; this call's k and v
        written to the cache; attention over every filled position under the layer type's mask."""
        cfg, cache, layer_type = self.config, self.caches[j], self.layer_types[i]
        q, k, v = primitives.split_qkv(qkv, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        rot_q, rot_k = self.kernels.qk_norm_rope(q, k, q_norm, k_norm, cfg.norm_eps, self.rope[j].get(layer_type))
        # the cache keeps keys already rotated: a key's position never changes
        keys, values = (rot_k, v) if cache is None else cache.write(i, rot_k, v)  # [n_kv_heads, ctx, head_dim]
        mask = self.masks[j][layer_type]  # [seq, ctx]
        if self.capture is None:
            z = self.kernels.attention(rot_q, keys, values, mask, cfg.attn_scale)  # [n_heads, seq, head_dim]
        else:  # capture: the probabilities too, which only the one-call form has
            z, pattern = primitives.attention(rot_q, keys, values, mask, cfg.attn_scale, softmax=self.kernels.softmax)
            named = {"q": q, "k": k, "v": v, "rot_q": rot_q, "rot_k": rot_k, "pattern": pattern, "z": z}
            self.record(i, **{"attn." + name: value for name, value in named.items()})
        return primitives.merge_heads(z)  # [seq, n_heads * head_dim]

    def record(self, i: int | None, **named: np.ndarray) -> None:
        """Store intermediates under ``blocks.{i}.`` + name (``i`` None: no prefix), if capturing."""
        if self.capture is not None:
            prefix = "" if i is None else f"blocks.{i}."
            self.capture.update({prefix + name: value for name, value in named.items()})

    def finish(self) -> None:
        """Move every cache on by its sequence's rows (their keys and values are written)."""
        for j, cache in enumerate(self.caches):
            if cache is not None:
                cache.advance(int(self.bounds[j + 1] - self.bounds[j]))
