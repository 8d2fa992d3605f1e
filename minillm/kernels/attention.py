"""Prefill attention in causal chunks: the same function as ``primitives.attention``, less work.

A long prefill's scores are ``[n_heads, seq, ctx]``: for hundreds of positions, several times the
L2 cache, and half of them masked. :func:`attention_in_chunks` takes ``ATTENTION_CHUNK`` query rows
at a time over only the keys they can see. ``TunedKernels.attention`` uses it above that many rows
when no intermediates are captured (capture needs the whole pattern, which only the one-call form
has); ``python -m benchmarks.speed`` times the prefill either way.
"""

from __future__ import annotations

import numpy as np

#: Query rows per chunk in :func:`attention_in_chunks` (prefill): 128 rows' scores for 9 heads over
#: 512 keys are 2.4 MB, near the L2 cache, instead of 9.4 MB for all 512 rows at once.
ATTENTION_CHUNK = 128


def attention_in_chunks(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float, chunk: int = ATTENTION_CHUNK
) -> np.ndarray:
    """``primitives.attention`` for a long ``seq``, ``chunk`` query rows at a time, each chunk over the keys
    it can see: ``z`` ``[n_heads, seq, head_dim]`` only (no pattern).

    Valid for causal and sliding-window masks, where query ``j`` (at position ``offset + j``) never
    sees a key after its own position: the chunk of rows ``a..b-1`` needs keys ``0..offset+b-1``
    only, so the masked upper triangle is never computed (about half the score and value FLOPs of
    a 512-token prefill with 4 chunks: 5/8 of the square) and each chunk's scores stay in cache.
    The work on the scores is cut the way FlashAttention cuts it (Dao et al. 2022, the deferred
    "rescaling" of section 3.1), without its tiling of the keys:

    - the mask is added to the chunk's own ``[rows, rows]`` tile only when every key before the
      chunk is visible to all its rows (a causal mask; under a sliding window whose edge reaches
      into the chunk, the whole row of keys takes the mask as before);
    - the weights' row sums are a matrix-vector product, ``exp(s) @ 1`` (BLAS sums it faster
      than ``np.sum`` over the last axis; the prefill is timed by ``python -m benchmarks.speed``);
    - the division by that sum is applied to ``z`` (``head_dim`` values a row) instead of to the
      weights (``ctx`` values a row): ``softmax(s) @ v = (exp(s) @ v) / sum(exp(s))``.

    The same function as ``primitives.attention``, with float32 rounding in another order (within 1e-5 of
    it here; the tests compare both with a float64 reference). Shapes as ``primitives.attention``.
    """
    *_, n_heads, seq, head_dim = q.shape
    n_kv_heads, ctx = k.shape[-3], k.shape[-2]
    group = n_heads // n_kv_heads
    offset = mask.shape[-1] - seq  # positions cached before this call
    ones = np.ones(ctx, dtype=np.float32)  # [ctx]: exp(scores) @ ones is each row's sum of weights
    q = (q * np.float32(scale)).reshape(n_kv_heads, group, seq, head_dim)  # scale the smaller side
    z = np.empty((n_kv_heads, group, seq, head_dim), dtype=np.float32)
    for a in range(0, seq, chunk):
        b = min(seq, a + chunk)
        end = offset + b  # the last row of this chunk sees keys 0..end-1
        rows = group * (b - a)
        scores = q[:, :, a:b].reshape(n_kv_heads, rows, head_dim) @ np.swapaxes(k[:, :end], -1, -2)  # [kv, rows, end]
        # Keys before the chunk are visible to every row when its last row sees key 0 (causal, or a
        # window not yet reached); then only the diagonal tile holds masked entries.
        tile = offset + a if mask[b - 1, 0] == 0 else 0
        scores.reshape(n_kv_heads, group, b - a, end)[..., tile:] += mask[a:b, tile:end]
        scores -= np.max(scores, axis=-1, keepdims=True)  # in place, as softmax does
        np.exp(scores, out=scores)
        weighted = (scores @ v[:, :end]).reshape(n_kv_heads, group, b - a, head_dim)  # unnormalised z
        total = (scores @ ones[:end]).reshape(n_kv_heads, group, b - a, 1)  # [kv, group, rows, 1]
        np.divide(weighted, total, out=z[:, :, a:b])
    return z.reshape(n_heads, seq, head_dim)
