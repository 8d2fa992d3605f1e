"""Transformer.forward: token ids + a KV cache -> logits. The one forward pass minillm has.

``prefill`` and ``decode_step`` (in ``lifecycle.py``) both call :meth:`Transformer.forward`; they
differ only in how many positions they feed. The positions come from the cache's ``length``, and
the masks use the same rule with that offset (see ``layers.causal_mask``).

Every family runs through the same lines; where one differs, a ``ModelConfig`` flag says so
(``config.py``) and the weights carry the extra tensors (``weights.py``)::

    x = embed(ids) [* sqrt(d_model): Gemma] [+ learned positions: GPT-2]
    per layer:  h = norm(x)                          RMSNorm | LayerNorm (GPT-2)
                q, k, v = h @ W_qkv.T [+ b_qkv]       biases: GPT-2, Qwen 2; + LoRA paths (unmerged)
                q, k = norm(q), norm(k)               QK-norm: Qwen 3, Gemma 3
                q, k = RoPE(q), RoPE(k)               not GPT-2; Gemma's sliding layers: own base
                z = attention(q, K, V, mask)          causal | sliding-window mask
                a = z @ W_o.T [+ b_o]; [a = norm(a)]  post-norm: Gemma 3
                x = x + a
                h = norm(x); m = MLP(h); [m = norm(m)]  SwiGLU | GeGLU | GPT-2's plain MLP
                x = x + m
    logits = norm(x) @ W_head.T [soft-capped, if final_logit_softcapping is set]

Intermediate names follow TransformerLens (embed, resid_pre, q, k, v, rot_q, rot_k, pattern, z,
attn_out, resid_mid, mlp_out, resid_post), so ``capture`` output reads like that library's cache.
The reference implementations are transformers' ``models/{llama,gpt2,qwen2,qwen3,gemma3}/modeling_*.py``.
"""

from __future__ import annotations

import numpy as np

from . import layers as L
from .config import FULL, SLIDING, ModelConfig
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
        self.act = L.ACTIVATIONS[config.hidden_act]
        self.layer_types = [config.layer_type(i) for i in range(config.num_hidden_layers)]
        # RoPE speeds per layer kind: Gemma 3's sliding layers turn with their own (local) base.
        self.inv_freq: dict[str, np.ndarray] = {}
        if config.position_embedding == "rope":
            self.inv_freq[FULL] = L.rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
            if SLIDING in self.layer_types:
                self.inv_freq[SLIDING] = (L.rope_inverse_frequencies(config.head_dim, config.rope_local_theta)
                                          if config.rope_local_theta is not None else self.inv_freq[FULL])
        empty = np.zeros((0, config.head_dim), dtype=np.float32)
        self._tables = {kind: (empty, empty) for kind in self.inv_freq}  # kind -> (cos, sin) [n, head_dim]

    def rope(self, positions: np.ndarray, kind: str = FULL) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin ``[seq, head_dim]`` for ``positions`` in layers of ``kind``; tables are computed
        once and grown on need."""
        cos, sin = self._tables[kind]
        needed = int(positions.max()) + 1
        if needed > len(cos):
            size = max(needed, min(2 * len(cos), self.config.max_position_embeddings), 256)
            cos, sin = self._tables[kind] = L.rope_tables(np.arange(size), self.inv_freq[kind])
        return cos[positions], sin[positions]

    def norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        """The family's norm over the last axis: RMSNorm, or LayerNorm with bias (GPT-2)."""
        if self.config.norm == "layernorm":
            return L.layer_norm(x, weight, bias, self.config.norm_eps)
        return L.rms_norm(x, weight, self.config.norm_eps)

    def mlp(self, h: np.ndarray, layer) -> np.ndarray:
        """The family's MLP on ``[seq, d_model]``: gated (SwiGLU, GeGLU) or GPT-2's plain one."""
        if layer.w_gate_up is not None:
            return L.gated_mlp(h, layer.w_gate_up, layer.w_down, self.act, layer.b_gate_up, layer.b_down, layer.lora)
        return L.plain_mlp(h, layer.w_up, layer.w_down, self.act, layer.b_up, layer.b_down, layer.lora)

    def masks(self, seq: int, start: int) -> dict[str, np.ndarray]:
        """The additive mask ``[seq, start + seq]`` per layer kind present in this model."""
        masks = {FULL: L.causal_mask(seq, start + seq, offset=start)}
        if SLIDING in self.layer_types:
            masks[SLIDING] = L.sliding_window_mask(seq, start + seq, offset=start, window=self.config.sliding_window)
        return masks

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
        rope = {kind: self.rope(positions, kind) for kind in self.inv_freq}  # kind -> cos, sin [seq, head_dim]
        masks = self.masks(seq, start)  # kind -> [seq, ctx]
        n_heads, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        x = L.embed(token_ids, w.embed_tokens)  # [seq, d_model]
        if cfg.embed_scale is not None:  # Gemma: sqrt(d_model), in the activation dtype (float32)
            x = x * np.float32(cfg.embed_scale)
        if w.pos_embed is not None:  # GPT-2: a learned vector per absolute position
            x = x + w.pos_embed[positions]
        if capture is not None:
            capture["embed"] = x
        for i, layer in enumerate(w.layers):
            kind = self.layer_types[i]
            # --- attention sub-block: x + W_o · attention(RoPE(q), RoPE(k), v) ---
            h = self.norm(x, layer.attn_norm, layer.attn_norm_bias)  # [seq, d_model]
            qkv = L.project(h, layer.w_qkv, layer.b_qkv, layer.lora.get("w_qkv"))  # [seq, q_dim + 2 kv_dim]
            q, k, v = np.split(qkv, [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=-1)
            q = q.reshape(seq, n_heads, hd).transpose(1, 0, 2)  # [n_heads, seq, head_dim]
            k = k.reshape(seq, n_kv, hd).transpose(1, 0, 2)  # [n_kv_heads, seq, head_dim]
            v = v.reshape(seq, n_kv, hd).transpose(1, 0, 2)  # [n_kv_heads, seq, head_dim]
            rot_q, rot_k = q, k
            if layer.q_norm is not None:  # QK-norm: each head's q and k to unit RMS, before RoPE
                rot_q = L.rms_norm(rot_q, layer.q_norm, cfg.norm_eps)
                rot_k = L.rms_norm(rot_k, layer.k_norm, cfg.norm_eps)
            if kind in rope:
                cos, sin = rope[kind]
                rot_q = L.apply_rope(rot_q, cos, sin)
                rot_k = L.apply_rope(rot_k, cos, sin)
            if cache is not None:
                keys, values = cache.write(i, rot_k, v)  # [n_kv_heads, ctx, head_dim]
            else:
                keys, values = rot_k, v
            z, pattern = L.attention(rot_q, keys, values, masks[kind], cfg.attn_scale)  # [n_heads, seq, head_dim]
            z_flat = z.transpose(1, 0, 2).reshape(seq, cfg.q_dim)  # [seq, q_dim]
            attn_out = L.project(z_flat, layer.w_o, layer.b_o, layer.lora.get("w_o"))  # [seq, d_model]
            if layer.attn_post_norm is not None:  # Gemma: normalise what attention adds
                attn_out = self.norm(attn_out, layer.attn_post_norm)
            resid_mid = x + attn_out
            # --- MLP sub-block: x + MLP(norm(x)) ---
            h = self.norm(resid_mid, layer.mlp_norm, layer.mlp_norm_bias)
            mlp_out = self.mlp(h, layer)  # [seq, d_model]
            if layer.mlp_post_norm is not None:
                mlp_out = self.norm(mlp_out, layer.mlp_post_norm)
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
        x = self.norm(x, w.final_norm, w.final_norm_bias)
        logits = x @ w.lm_head.T  # [seq, d_model] @ [d_model, vocab] -> [seq, vocab]
        if cfg.final_logit_softcapping is not None:
            logits = L.softcap(logits, cfg.final_logit_softcapping)
        return logits
