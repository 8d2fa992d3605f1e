"""The transformer's math, one small pure function per idea, float32 throughout.

No batch dimension: minillm runs one request, so activations are ``[seq, d_model]`` and attention
tensors ``[n_heads, seq, head_dim]``. Letters: ``seq`` = positions in this call, ``ctx`` = positions
in the cache (past + this call), ``vocab``, ``d_model``, ``n_heads``, ``n_kv_heads``, ``head_dim``.

The numerical reference is Hugging Face transformers' ``models/llama/modeling_llama.py``
(``LlamaRMSNorm``, ``LlamaRotaryEmbedding``, ``rotate_half``, ``eager_attention_forward``,
``LlamaMLP``); the ideas come from Vaswani et al. 2017 (attention), Zhang & Sennrich 2019 (RMSNorm),
Su et al. 2021 (RoPE), Ainslie et al. 2023 (GQA) and Shazeer 2020 (SwiGLU).
"""

from __future__ import annotations

import numpy as np


def embed(token_ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Look up token embeddings: ``[seq]`` int ids, ``[vocab, d_model]`` table -> ``[seq, d_model]``."""
    return table[token_ids]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``.

    ``x`` is ``[seq, d_model]`` float32, ``weight`` ``[d_model]``; returns ``[seq, d_model]``.
    Unlike LayerNorm it neither subtracts the mean nor adds a bias.
    """
    variance = np.mean(x * x, axis=-1, keepdims=True)  # [seq, 1]
    return x / np.sqrt(variance + np.float32(eps)) * weight


def rope_inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """RoPE's per-pair rotation speeds ``theta^(-2i/head_dim)`` for i in [0, head_dim/2): ``[head_dim/2]``.

    Computed in float32 like transformers, so angles agree to the last bit that matters.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the rotation angles ``position * inv_freq``: each ``[seq, head_dim]``.

    Angles are computed in float32 (transformers disables autocast here for the same reason:
    a half-precision angle at position 5,000 is off by whole radians). The two halves repeat the
    same angles because HF's layout pairs dimension ``j`` with ``j + head_dim/2`` ("half-split").
    """
    angles = positions.astype(np.float32)[:, None] * inv_freq[None, :]  # [seq, head_dim/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [seq, head_dim]
    return np.cos(angles), np.sin(angles)


def rotate_half(x: np.ndarray) -> np.ndarray:
    """``[x1, x2] -> [-x2, x1]`` on the last axis (the 90-degree turn of each (j, j + half) pair)."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate queries or keys by their position (Su et al. 2021, RoFormer).

    ``x`` is ``[heads, seq, head_dim]``, ``cos``/``sin`` ``[seq, head_dim]``; returns the same shape.
    After rotation, ``q_m . k_n`` depends only on ``m - n``: attention sees relative position.
    """
    return x * cos + rotate_half(x) * sin


def causal_mask(seq: int, ctx: int, offset: int = 0) -> np.ndarray:
    """The additive causal mask ``[seq, ctx]``: 0 where a query may look, -inf where it may not.

    Query row ``i`` sits at absolute position ``offset + i`` and may see keys ``0..offset + i``.
    Prefill of 4 tokens (``offset=0``, ``ctx=4``), and a decode step at position 4 (``offset=4``,
    ``ctx=5``) use the same rule::

        prefill            decode (one row)
        0 - - -            0 0 0 0 0
        0 0 - -
        0 0 0 -
        0 0 0 0
    """
    query_pos = offset + np.arange(seq)[:, None]  # [seq, 1]
    key_pos = np.arange(ctx)[None, :]  # [1, ctx]
    return np.where(key_pos <= query_pos, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax (subtract the max first), float32 in, float32 out."""
    x = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)


def attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention with grouped-query heads (GQA).

    Args:
        q: ``[n_heads, seq, head_dim]`` rotated queries.
        k, v: ``[n_kv_heads, ctx, head_dim]``, the cache's filled slice (past + this call).
        mask: ``[seq, ctx]`` additive mask from :func:`causal_mask`.
        scale: multiplies ``q . k``, usually ``head_dim ** -0.5``.

    Returns:
        ``(z, pattern)``: ``z`` ``[n_heads, seq, head_dim]`` and the attention probabilities
        ``[n_heads, seq, ctx]``.

    Query head ``h`` reads kv head ``h // group`` (HF's ``repeat_kv`` order). Instead of copying
    k and v ``group`` times we fold the group into the query rows: one matmul per kv head.
    """
    n_heads, seq, head_dim = q.shape
    n_kv_heads, ctx, _ = k.shape
    group = n_heads // n_kv_heads
    q = q.reshape(n_kv_heads, group * seq, head_dim)  # [n_kv_heads, group*seq, head_dim]
    scores = (q @ k.transpose(0, 2, 1)) * np.float32(scale)  # [n_kv_heads, group*seq, ctx]
    scores = scores.reshape(n_heads, seq, ctx) + mask  # [n_heads, seq, ctx]
    pattern = softmax(scores, axis=-1)
    z = pattern.reshape(n_kv_heads, group * seq, ctx) @ v  # [n_kv_heads, group*seq, head_dim]
    return z.reshape(n_heads, seq, head_dim), pattern


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU / swish: ``x * sigmoid(x)``.

    ``sigmoid(x) = (1 + tanh(x / 2)) / 2`` is the same function, but never overflows ``exp``.
    """
    return x * (np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * x)))


def swiglu_mlp(x: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """SwiGLU MLP (Shazeer 2020): ``down(silu(gate(x)) * up(x))``.

    ``x`` ``[seq, d_model]``, ``w_gate_up`` ``[d_model, 2 * ffn]`` (gate | up), ``w_down``
    ``[ffn, d_model]``; returns ``[seq, d_model]``.
    """
    gate_up = x @ w_gate_up  # [seq, 2 * ffn]
    ffn = w_down.shape[0]
    gate, up = gate_up[:, :ffn], gate_up[:, ffn:]  # each [seq, ffn]
    return (silu(gate) * up) @ w_down  # [seq, d_model]
