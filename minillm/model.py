"""Transformer.forward: token ids + a KV cache -> logits. The one forward pass minillm has.

``prefill`` and ``decode_step`` (in ``lifecycle.py``) both call :meth:`Transformer.forward`; they
differ only in how many positions they feed. The positions come from the cache's ``length``, and
the causal mask uses the same rule with that offset (see ``layers.causal_mask``).

Intermediate names follow TransformerLens (embed, resid_pre, q, k, v, rot_q, rot_k, pattern, z,
attn_out, resid_mid, mlp_out, resid_post), so ``capture`` output reads like that library's cache.
"""

from __future__ import annotations

import numpy as np

from . import layers as L
from .config import ModelConfig
from .kv_cache import KVCache
from .weights import Weights


class Transformer:
    """A decoder-only transformer: weights (shared by every request) and its RoPE tables.

    Per-request state (the KV cache) is passed in, never stored here, so one loaded model can
    serve request after request.
    """

    def __init__(self, config: ModelConfig, weights: Weights):
        self.config = config
        self.weights = weights
        self.inv_freq = L.rope_inverse_frequencies(config.head_dim, config.rope_theta)  # [head_dim/2]
        self._cos = self._sin = np.zeros((0, config.head_dim), dtype=np.float32)

    def rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin ``[seq, head_dim]`` for ``positions``; tables are computed once and grown on need."""
        needed = int(positions.max()) + 1
        if needed > len(self._cos):
            size = max(needed, min(2 * len(self._cos), self.config.max_position_embeddings), 256)
            self._cos, self._sin = L.rope_tables(np.arange(size), self.inv_freq)
        return self._cos[positions], self._sin[positions]

    def forward(
        self,
        token_ids: np.ndarray,
        cache: KVCache | None = None,
        *,
        last_only: bool = False,
        capture: dict[str, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Run the model over ``token_ids`` at positions ``cache.length ..``.

        Args:
            token_ids: ``[seq]`` integer ids.
            cache: the request's KV cache, written at ``cache.length..+seq`` and advanced by
                ``seq``. ``None`` attends over these ``seq`` tokens only (a full recomputation,
                the "no cache" baseline).
            last_only: compute logits for the last position only (what generation needs; saves
                a ``[seq, d_model] @ [d_model, vocab]`` product in prefill).
            capture: if a dict, intermediates are stored in it under TransformerLens-style names
                (``blocks.{i}.attn.pattern`` ``[n_heads, seq, ctx]``, ``blocks.{i}.resid_post``...).

        Returns:
            float32 logits ``[seq, vocab]`` (``[1, vocab]`` with ``last_only``).

        Raises:
            KVCacheFullError: the cache has no room for ``seq`` more positions.
            KVCacheMismatchError: the cache was built for another model.
        """
        cfg, w = self.config, self.weights
        token_ids = np.asarray(token_ids, dtype=np.int64)
        seq = token_ids.shape[0]
        start = 0
        if cache is not None:
            cache.check_compatible(cfg)
            cache.check_room(seq)
            start = cache.length
        positions = np.arange(start, start + seq)  # [seq]
        cos, sin = self.rope(positions)  # [seq, head_dim] each
        mask = L.causal_mask(seq, start + seq, offset=start)  # [seq, ctx]
        scale = cfg.head_dim**-0.5
        n_heads, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        x = L.embed(token_ids, w.embed_tokens)  # [seq, d_model]
        if capture is not None:
            capture["embed"] = x
        for i, layer in enumerate(w.layers):
            # --- attention sub-block: x + W_o · attention(RoPE(q), RoPE(k), v) ---
            h = L.rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)  # [seq, d_model]
            qkv = h @ layer.w_qkv  # [seq, q_dim + 2 kv_dim]
            q, k, v = np.split(qkv, [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=-1)
            q = q.reshape(seq, n_heads, hd).transpose(1, 0, 2)  # [n_heads, seq, head_dim]
            k = k.reshape(seq, n_kv, hd).transpose(1, 0, 2)  # [n_kv_heads, seq, head_dim]
            v = v.reshape(seq, n_kv, hd).transpose(1, 0, 2)  # [n_kv_heads, seq, head_dim]
            rot_q = L.apply_rope(q, cos, sin)
            rot_k = L.apply_rope(k, cos, sin)
            if cache is not None:
                keys, values = cache.write(i, rot_k, v)  # [n_kv_heads, ctx, head_dim]
            else:
                keys, values = rot_k, v
            z, pattern = L.attention(rot_q, keys, values, mask, scale)  # [n_heads, seq, head_dim]
            attn_out = z.transpose(1, 0, 2).reshape(seq, cfg.q_dim) @ layer.w_o  # [seq, d_model]
            resid_mid = x + attn_out
            # --- MLP sub-block: x + MLP(norm(x)) ---
            h = L.rms_norm(resid_mid, layer.mlp_norm, cfg.rms_norm_eps)
            mlp_out = L.swiglu_mlp(h, layer.w_gate_up, layer.w_down)  # [seq, d_model]
            if capture is not None:
                prefix = f"blocks.{i}."
                capture.update({prefix + "resid_pre": x, prefix + "attn.q": q, prefix + "attn.k": k,
                                prefix + "attn.v": v, prefix + "attn.rot_q": rot_q, prefix + "attn.rot_k": rot_k,
                                prefix + "attn.pattern": pattern, prefix + "attn.z": z,
                                prefix + "attn_out": attn_out, prefix + "resid_mid": resid_mid,
                                prefix + "mlp_out": mlp_out})
            x = resid_mid + mlp_out
            if capture is not None:
                capture[prefix + "resid_post"] = x
        if cache is not None:
            cache.advance(seq)

        if last_only:
            x = x[-1:]  # [1, d_model]
        x = L.rms_norm(x, w.final_norm, cfg.rms_norm_eps)
        return x @ w.lm_head  # [seq, vocab]
