"""The KV cache: every layer's keys and values for the positions seen so far.

Without it, each decode step would recompute keys and values for the whole sequence (cost grows
with length). With it, a step computes k and v for one new position and reads the rest.

Preallocated once per request: ``keys`` and ``values`` are ``[n_layers, n_kv_heads, max_seq_len,
head_dim]`` float32, of which positions ``0..length-1`` are filled. Prefill writes ``0..n-1``; each
decode step writes one. Its size is known before the first token::

    bytes_per_token = 2 (k and v) * n_layers * n_kv_heads * head_dim * 4 (float32)
"""

from __future__ import annotations

import numpy as np

from minillm.errors import InvalidRequestError, KVCacheFullError, KVCacheMismatchError
from minillm.model.config import ModelConfig, kv_bytes_per_token


class KVCache:
    """Per-request state: keys and values ``[n_layers, n_kv_heads, max_seq_len, head_dim]`` + ``length``.

    Writing is two steps so every layer of one forward pass writes the same positions:
    :meth:`write` (per layer, at ``length..length+seq-1``) then :meth:`advance` (once, after the
    last layer).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int):
        if max_seq_len <= 0:
            raise InvalidRequestError(f"KVCache max_seq_len must be positive, got {max_seq_len}.")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        shape = (num_layers, num_kv_heads, max_seq_len, head_dim)
        # np.zeros maps untouched pages lazily; nbytes is still what the cache reserves.
        self.keys = np.zeros(shape, dtype=np.float32)
        self.values = np.zeros(shape, dtype=np.float32)
        self.length = 0

    @classmethod
    def for_model(cls, config: ModelConfig, max_seq_len: int | None = None) -> KVCache:
        """A cache shaped for ``config``; ``max_seq_len`` defaults to the model's context.

        Raises:
            KVCacheFullError: ``max_seq_len`` larger than ``max_position_embeddings``.
        """
        context = config.max_position_embeddings
        if max_seq_len is None:
            max_seq_len = context
        if max_seq_len > context:
            raise KVCacheFullError(
                f"max_seq_len={max_seq_len:,} is longer than the model's context of {context:,} "
                "positions; pass max_seq_len <= the context."
            )
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, max_seq_len)

    # --- sizes, in bytes ------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """Bytes one position occupies across all layers, k and v: ``2 * L * kv_heads * head_dim * 4``."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.keys.itemsize)

    @property
    def nbytes(self) -> int:
        """Bytes reserved for ``max_seq_len`` positions (keys + values)."""
        return self.keys.nbytes + self.values.nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes holding the ``length`` filled positions."""
        return self.length * self.bytes_per_token

    @property
    def free_positions(self) -> int:
        return self.max_seq_len - self.length

    # --- writing and reading --------------------------------------------------------------------
    def check_room(self, seq: int) -> None:
        """Raise :class:`KVCacheFullError` unless ``seq`` more positions fit."""
        if self.length + seq > self.max_seq_len:
            raise KVCacheFullError(
                f"the KV cache holds {self.max_seq_len:,} positions, {self.length:,} are filled and "
                f"{seq:,} more were asked for; shorten the prompt, lower max_new_tokens or build "
                "the cache with a larger max_seq_len."
            )

    def check_compatible(self, config: ModelConfig) -> None:
        """Raise :class:`KVCacheMismatchError` if this cache was built for another model's shape."""
        want = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        have = (self.num_layers, self.num_kv_heads, self.head_dim)
        if want != have:
            raise KVCacheMismatchError(
                f"this KV cache is shaped (layers, kv_heads, head_dim)={have} but the model needs "
                f"{want}; build one with KVCache.for_model(model.config)."
            )

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store this call's ``k``, ``v`` (``[n_kv_heads, seq, head_dim]``) for ``layer`` at
        positions ``length..length+seq-1``; return the filled keys and values
        ``[n_kv_heads, length+seq, head_dim]`` (views, no copy).
        """
        end = self.length + k.shape[1]  # room was checked once, before the first layer
        self.keys[layer, :, self.length : end] = k
        self.values[layer, :, self.length : end] = v
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def advance(self, seq: int) -> None:
        """Mark ``seq`` more positions as filled (after every layer has written them)."""
        self.length += seq

    # --- request lifecycle ----------------------------------------------------------------------
    def truncate(self, length: int) -> None:
        """Forget positions ``length..``; the next write starts at ``length`` (e.g. to reuse a prefix)."""
        if not 0 <= length <= self.length:
            raise InvalidRequestError(f"cannot truncate a cache of length {self.length} to {length}.")
        self.length = length

    def reset(self) -> None:
        """Empty the cache for the next request (the memory stays allocated)."""
        self.length = 0

    def free(self) -> None:
        """Release the arrays; the cache can no longer be used."""
        self.keys = np.zeros((self.num_layers, self.num_kv_heads, 0, self.head_dim), dtype=np.float32)
        self.values = self.keys
        self.max_seq_len = 0
        self.length = 0

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"length={self.length}/{self.max_seq_len}, nbytes={self.nbytes:,})"
        )
