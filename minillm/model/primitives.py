"""The transformer's math, one small pure function per idea, float32 throughout.

Activations are ``[seq, d_model]`` and attention tensors ``[n_heads, seq, head_dim]``. A batch of
requests adds no axis to the projections: ``Transformer.forward_batch`` stacks every sequence's rows
on ``seq`` (a pass's rows: ``passes.py``). Attention alone takes a leading batch axis, in the batched decode step
(:func:`attention`'s ``[B, n_heads, seq, head_dim]``: one decode row each for ``B`` sequences).
Letters: ``seq`` = positions in this call, ``ctx`` = positions in the cache (past + this call),
``vocab``, ``d_model``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``B`` = sequences.

Every family minillm runs is built from these pieces; ``transformer.py`` picks among them with the
flags in ``ModelConfig`` (RMSNorm or LayerNorm, RoPE or learned positions, gated or plain MLP, ...).

The numerical reference is Hugging Face transformers: ``models/llama/modeling_llama.py``
(``LlamaRMSNorm``, ``LlamaRotaryEmbedding``, ``rotate_half``, ``eager_attention_forward``,
``LlamaMLP``), ``modeling_rope_utils.py`` (``_compute_llama3_parameters``), ``models/gpt2`` (LayerNorm,
``gelu_new``), ``models/gemma3`` (``Gemma3RMSNorm``, sliding windows, soft-capping) and
``masking_utils.py`` (``sliding_window_overlay``). The ideas come from Vaswani et al. 2017
(attention), Ba et al. 2016 (LayerNorm), Zhang & Sennrich 2019 (RMSNorm), Su et al. 2021 (RoPE),
Ainslie et al. 2023 (GQA), Shazeer 2020 (GLU variants: SwiGLU, GeGLU), Beltagy et al. 2020
(sliding-window attention).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np


# --- embeddings and norms -------------------------------------------------------------------------
def embed(token_ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Look up token embeddings: ``[seq]`` int ids, ``[vocab, d_model]`` table -> ``[seq, d_model]``."""
    return table[token_ids]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``.

    ``x`` is ``[..., dim]`` float32 (``[seq, d_model]``, or ``[heads, seq, head_dim]`` for QK-norm),
    ``weight`` ``[dim]``; returns the shape of ``x``. Unlike LayerNorm it neither subtracts the
    mean nor adds a bias. Gemma's variant multiplies by ``1 + weight``; ``weights.py`` adds that
    ``1`` once at load time, so the same function serves both.
    """
    variance = np.mean(x * x, axis=-1, keepdims=True)  # [..., 1]
    return x / np.sqrt(variance + np.float32(eps)) * weight


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm (Ba et al. 2016), as in GPT-2: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    ``x`` ``[seq, d_model]`` float32; ``weight`` and ``bias`` ``[d_model]``. The variance is the
    biased one (divide by ``d_model``), like ``torch.nn.LayerNorm``.
    """
    centered = x - np.mean(x, axis=-1, keepdims=True)  # [seq, d_model]
    variance = np.mean(centered * centered, axis=-1, keepdims=True)  # [seq, 1]
    return centered / np.sqrt(variance + np.float32(eps)) * weight + bias


# --- positions: RoPE --------------------------------------------------------------------------------
def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> np.ndarray:
    """RoPE's per-pair rotation speeds ``theta^(-2i/head_dim)`` for i in [0, head_dim/2): ``[head_dim/2]``.

    The exponents ``2i/head_dim`` are float32 like transformers'; the power is taken in float64 and
    rounded once to float32, the correctly rounded value torch's pow gives (NumPy's float32 pow
    can be an ulp or two off, and slow pairs at long positions would feel it). ``scaling``
    (``ModelConfig.rope_scaling``) stretches them for long contexts: ``linear`` divides every
    speed by ``factor``; ``llama3`` see :func:`llama3_scaled_frequencies`. ``None`` or
    ``{"rope_type": "default"}`` leaves them alone. Raises ``ValueError`` for another type
    (``families.py`` refuses those earlier, with the fix).
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    powers = (np.float64(theta) ** exponents.astype(np.float64)).astype(np.float32)  # [head_dim/2]
    inv_freq = np.float32(1.0) / powers
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":  # position interpolation: positions squeezed by `factor`
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if rope_type == "llama3":
        return llama3_scaled_frequencies(inv_freq, scaling)
    raise ValueError(f"RoPE scaling {rope_type!r} is not implemented")


def llama3_scaled_frequencies(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """Llama 3.1's RoPE scaling (``rope_type: llama3``): slow pairs stretched, fast pairs kept.

    A pair whose wavelength ``2 pi / inv_freq`` is longer than ``original_max_position_embeddings /
    low_freq_factor`` never completed a turn in pre-training: divide its speed by ``factor``.
    Shorter than ``original / high_freq_factor``: keep it. In between: blend the two smoothly.
    ``inv_freq`` ``[head_dim/2]`` float32 in and out; float32 arithmetic in transformers' order
    (``modeling_rope_utils._compute_llama3_parameters``).
    """
    f32 = np.float32
    factor, old_context = f32(scaling["factor"]), f32(scaling["original_max_position_embeddings"])
    low, high = f32(scaling["low_freq_factor"]), f32(scaling["high_freq_factor"])
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = f32(2 * math.pi) / inv_freq  # [head_dim/2]
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


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


# --- masks ------------------------------------------------------------------------------------------
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


def sliding_window_mask(seq: int, ctx: int, offset: int = 0, window: int = 4096) -> np.ndarray:
    """The additive mask of a sliding-window layer ``[seq, ctx]``: causal, and at most ``window`` back.

    Query at position ``p`` sees keys ``p - window + 1 .. p`` (itself and the ``window - 1`` before
    it; transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - window``). Older keys stay in
    the cache for the full-attention layers but this layer never reads them. Prefill of 6 tokens
    with ``window=3``, then a decode step at position 6 (``offset=6``, ``ctx=7``)::

        prefill              decode (one row)
        0 - - - - -          - - - - 0 0 0
        0 0 - - - -
        0 0 0 - - -
        - 0 0 0 - -
        - - 0 0 0 -
        - - - 0 0 0

    ``print(observe.pictures.mask_picture(sliding_window_mask(6, 6, window=3)))`` draws the left one.
    """
    query_pos = offset + np.arange(seq)[:, None]  # [seq, 1]
    key_pos = np.arange(ctx)[None, :]  # [1, ctx]
    visible = (key_pos <= query_pos) & (key_pos > query_pos - window)  # [seq, ctx]
    return np.where(visible, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


# --- attention --------------------------------------------------------------------------------------
def softmax(x: np.ndarray, axis: int = -1, *, out: np.ndarray | None = None) -> np.ndarray:
    """Numerically stable softmax (subtract the max first), float32 in, float32 out.

    ``out=x`` overwrites ``x`` instead of allocating three arrays of its size (prefill's scores
    are ``[n_heads, seq, ctx]``: 9 MB per layer at 512 tokens).
    """
    out = np.subtract(x, np.max(x, axis=axis, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= np.sum(out, axis=axis, keepdims=True)
    return out


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """Soft-capping (Gemma's ``final_logit_softcapping``): ``cap * tanh(x / cap)`` squashes values
    smoothly into ``(-cap, cap)``."""
    return np.tanh(x / np.float32(cap)) * np.float32(cap)


def attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float, *, softmax=softmax
) -> tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention with grouped-query heads (GQA).

    Args:
        q: ``[n_heads, seq, head_dim]`` rotated queries.
        k, v: ``[n_kv_heads, ctx, head_dim]``, the cache's filled slice (past + this call).
        mask: ``[seq, ctx]`` additive mask from :func:`causal_mask` or :func:`sliding_window_mask`.
        scale: multiplies ``q . k``: ``head_dim ** -0.5``, or Gemma's ``query_pre_attn_scalar ** -0.5``.
        softmax: the normalizer, called as ``softmax(scores, axis=-1, out=scores)``: the textbook's
            :func:`softmax`; the seam hands a student's (``Kernels.attention``, the exercises).

    Returns:
        ``(z, pattern)``: ``z`` ``[n_heads, seq, head_dim]`` and the attention probabilities
        ``[n_heads, seq, ctx]``.

    Query head ``h`` reads kv head ``h // group`` (HF's ``repeat_kv`` order). Instead of copying
    k and v ``group`` times we fold the group into the query rows: one matmul per kv head.
    Leading axes are carried through: ``q`` ``[B, n_heads, seq, head_dim]``, ``k``/``v``
    ``[B, n_kv_heads, ctx, head_dim]`` and ``mask`` ``[B, 1, seq, ctx]`` attend ``B`` sequences
    at once (the engine room's batched decode step, ``minillm/kernels/paged_decode.py``: each its own
    keys, padded to one ``ctx``, and its own mask).
    """
    *lead, n_heads, seq, head_dim = q.shape
    n_kv_heads, ctx = k.shape[-3], k.shape[-2]
    group = n_heads // n_kv_heads
    q = q.reshape(*lead, n_kv_heads, group * seq, head_dim) * np.float32(scale)  # scale the smaller side
    scores = q @ np.swapaxes(k, -1, -2)  # [..., n_kv_heads, group*seq, ctx]
    scores = scores.reshape(*lead, n_heads, seq, ctx)  # [..., n_heads, seq, ctx]
    scores += mask  # in place: no second [n_heads, seq, ctx] array
    pattern = softmax(scores, axis=-1, out=scores)
    z = pattern.reshape(*lead, n_kv_heads, group * seq, ctx) @ v  # [..., n_kv_heads, group*seq, head_dim]
    return z.reshape(*lead, n_heads, seq, head_dim), pattern


def split_qkv(qkv: np.ndarray, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[np.ndarray, ...]:
    """The fused projection's output ``[seq, q_dim + 2 kv_dim]`` -> ``q`` ``[n_heads, seq, head_dim]``,
    ``k`` and ``v`` ``[n_kv_heads, seq, head_dim]``: heads side by side on the page, split into an axis
    (views, no copy)."""
    seq, q_dim, kv_dim = qkv.shape[0], n_heads * head_dim, n_kv_heads * head_dim
    q, k, v = qkv[:, :q_dim], qkv[:, q_dim : q_dim + kv_dim], qkv[:, q_dim + kv_dim :]  # views
    q = q.reshape(seq, n_heads, head_dim).transpose(1, 0, 2)  # [n_heads, seq, head_dim]
    k = k.reshape(seq, n_kv_heads, head_dim).transpose(1, 0, 2)  # [n_kv_heads, seq, head_dim]
    v = v.reshape(seq, n_kv_heads, head_dim).transpose(1, 0, 2)  # [n_kv_heads, seq, head_dim]
    return q, k, v


def merge_heads(z: np.ndarray) -> np.ndarray:
    """Attention's output ``[n_heads, seq, head_dim]`` -> ``[seq, n_heads * head_dim]``, heads side by side."""
    n_heads, seq, head_dim = z.shape
    return z.transpose(1, 0, 2).reshape(seq, n_heads * head_dim)


def qk_norm_rope(
    q: np.ndarray, k: np.ndarray, q_norm, k_norm, eps: float, rope, *, rms_norm=rms_norm, apply_rope=apply_rope
) -> tuple[np.ndarray, np.ndarray]:
    """QK-norm, then RoPE, on queries and keys ``[..., heads, seq, head_dim]``.

    ``q_norm``, ``k_norm``: ``[head_dim]`` weights of each head's :func:`rms_norm` (Qwen 3, Gemma 3), None
    without QK-norm; ``rope``: (cos, sin) broadcasting to ``q`` and ``k``, None without RoPE (GPT-2).
    ``rms_norm``, ``apply_rope``: the textbook's, unless the seam hands a student's (``Kernels``).
    """
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    if rope is not None:
        cos, sin = rope
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
    return q, k


# --- projections, activations and MLPs ------------------------------------------------------------
def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """``x @ w.T (+ b)``, PyTorch's ``F.linear``: ``x`` ``[seq, in]``, ``w`` ``[out, in]``, ``b`` ``[out]``.

    ``w.T`` is a view (no copy): BLAS reads ``w``'s rows, so in decode each output is a dot
    product over contiguous memory (why this layout: ``weights.py``). One row is a matrix-vector
    product, more rows one general product (the engine room's ``TunedKernels`` may take another
    formulation of the same sums: ``minillm/kernels/products.py``).
    """
    y = x @ w.T  # [seq, in] @ [in, out] -> [seq, out]
    if b is not None:
        y += b  # in place: the product is a fresh array, no second allocation
    return y


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU / swish: ``x * sigmoid(x)``.

    ``sigmoid(x) = (1 + tanh(x / 2)) / 2`` is the same function, but never overflows ``exp``.
    One new array, the rest in place (prefill's ``[512, 1536]`` would take four): the same
    operations in the same order, so the same numbers.
    """
    s = np.multiply(x, np.float32(0.5))  # x / 2, a fresh array
    np.tanh(s, out=s)
    s += np.float32(1.0)
    s *= np.float32(0.5)  # sigmoid(x)
    s *= x
    return s


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (GPT-2's ``gelu_new``, Gemma's ``gelu_pytorch_tanh``):

    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.
    """
    inner = np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * (x * x * x))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))


#: ModelConfig.hidden_act -> the function.
ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"silu": silu, "gelu_tanh": gelu_tanh}
