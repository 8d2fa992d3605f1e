"""The KV cache: every layer's keys and values for the positions seen so far.

Without it, each decode step would recompute keys and values for the whole sequence (cost grows
with length). With it, a step computes k and v for one new position and reads the rest.

Preallocated once per request: ``keys`` and ``values`` are ``[n_layers, n_kv_heads, max_seq_len,
head_dim]`` float32, of which positions ``0..length-1`` are filled. Prefill writes ``0..n-1``; each
decode step writes one. Its size is known before the first token::

    bytes_per_token = 2 (k and v) * n_layers * n_kv_heads * head_dim * 4 (float32)

The cache can hold its entries in fewer bytes (``dtype``); attention still reads float32:

    dtype     held as                                         bytes per entry of head_dim values
    float32   float32                                         4 * head_dim
    float16   float16 (rounded to nearest)                    2 * head_dim
    int8      int8 + a float32 scale per position and head    head_dim + 4
              (symmetric: scale = max|k| / 127 over head_dim)
"""

from __future__ import annotations

import numpy as np

from minillm.errors import InvalidRequestError, KVCacheFullError, KVCacheMismatchError
from minillm.model.config import KV_DTYPES, ModelConfig


class CacheWindow:
    """What a cache of ``length`` filled positions out of ``max_seq_len`` says of itself; shared by
    :class:`KVCache` and the paged pool's ``PagedSequence`` (each has ``bytes_per_token``)."""

    @property
    def used_bytes(self) -> int:
        """Bytes holding the ``length`` filled positions."""
        return self.length * self.bytes_per_token

    @property
    def free_positions(self) -> int:
        """Positions still free: ``max_seq_len - length``."""
        return self.max_seq_len - self.length


class KVCache(CacheWindow):
    """Per-request state: keys and values ``[n_layers, n_kv_heads, max_seq_len, head_dim]`` + ``length``.

    Writing is two steps so every layer of one forward pass writes the same positions:
    :meth:`write` (per layer, at ``length..length+seq-1``) then :meth:`advance` (once, after the
    last layer).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int, dtype: str = "float32"):
        if max_seq_len <= 0:
            raise InvalidRequestError(f"KVCache max_seq_len must be positive, got {max_seq_len}.")
        if dtype not in KV_DTYPES:
            raise InvalidRequestError(f"KVCache dtype must be one of {', '.join(KV_DTYPES)}; got {dtype!r}.")
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        shape = (num_layers, num_kv_heads, max_seq_len, head_dim)
        # np.zeros maps untouched pages lazily; nbytes is still what the cache reserves.
        self.keys = np.zeros(shape, dtype=dtype)  # KV_DTYPES' names are NumPy's
        self.values = np.zeros(shape, dtype=dtype)
        # int8: one float32 scale per (layer, head, position), for keys and for values
        scales = shape[:3] if dtype == "int8" else (0, 0, 0)
        self.key_scales = np.zeros(scales, dtype=np.float32)  # [n_layers, n_kv_heads, max_seq_len]
        self.value_scales = np.zeros(scales, dtype=np.float32)
        self.length = 0

    @classmethod
    def for_model(cls, config: ModelConfig, max_seq_len: int | None = None, dtype: str = "float32") -> KVCache:
        """A cache shaped for ``config``; ``max_seq_len`` defaults to the model's context; ``dtype``
        float32 | float16 | int8 (module docstring).

        Raises:
            KVCacheFullError: ``max_seq_len`` larger than ``max_position_embeddings``.
            InvalidRequestError: an unknown ``dtype``.
        """
        context = config.max_position_embeddings
        if max_seq_len is None:
            max_seq_len = context
        if max_seq_len > context:
            too_long = f"is longer than the model's context of {context:,} positions"
            raise KVCacheFullError(
                f"max_seq_len={max_seq_len:,} {too_long}; pass max_seq_len <= the context.",
                cli_message=f"--max-seq-len {max_seq_len:,} {too_long}; pass --max-seq-len {context:,} or less.",
            )
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, max_seq_len, dtype)

    # --- sizes, in bytes ------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """Bytes one position occupies across all layers, k and v: ``2 * L * kv_heads * head_dim * 4``
        (float32); ``* 2`` (float16); ``2 * L * kv_heads * (head_dim + 4)`` (int8 + float32 scales):
        what the arrays reserve, per position (``ModelConfig.kv_bytes_per_token`` says it from the config)."""
        return self.nbytes // self.max_seq_len

    @property
    def nbytes(self) -> int:
        """Bytes reserved for ``max_seq_len`` positions (keys + values, and int8's scales)."""
        return self.keys.nbytes + self.values.nbytes + self.key_scales.nbytes + self.value_scales.nbytes

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
        check_shape(config, self, "KV cache", "KVCache.for_model(model.config)")

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store this call's ``k``, ``v`` (``[n_kv_heads, seq, head_dim]``) for ``layer`` at
        positions ``length..length+seq-1``; return the filled keys and values
        ``[n_kv_heads, length+seq, head_dim]`` (views, no copy).
        """
        end = self.length + k.shape[1]  # room was checked once, before the first layer
        if self.dtype == "int8":
            for store, scales, x in ((self.keys, self.key_scales, k), (self.values, self.value_scales, v)):
                amax = np.max(np.abs(x), axis=-1)  # [n_kv_heads, seq]
                scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
                store[layer, :, self.length : end] = np.rint(x / scale[..., None])
                scales[layer, :, self.length : end] = scale
            return self.read(layer, end)
        self.keys[layer, :, self.length : end] = k  # float16: rounded to nearest here
        self.values[layer, :, self.length : end] = v
        if self.dtype == "float16":
            return self.read(layer, end)
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def read(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of positions ``0..end-1`` of ``layer`` as float32 ``[n_kv_heads, end, head_dim]``
        (a view at float32; a fresh array widened from float16 or int8 * scale otherwise)."""
        k, v = self.keys[layer, :, :end], self.values[layer, :, :end]
        if self.dtype == "int8":
            k = k.astype(np.float32) * self.key_scales[layer, :, :end, None]
            v = v.astype(np.float32) * self.value_scales[layer, :, :end, None]
        return k.astype(np.float32, copy=False), v.astype(np.float32, copy=False)

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
        self.keys = np.zeros((self.num_layers, self.num_kv_heads, 0, self.head_dim), dtype=self.keys.dtype)
        self.values = self.keys
        self.key_scales = self.value_scales = np.zeros((0, 0, 0), dtype=np.float32)
        self.max_seq_len = 0
        self.length = 0

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"length={self.length}/{self.max_seq_len}, dtype={self.dtype}, nbytes={self.nbytes:,})"
        )


def check_shape(config: ModelConfig, cache, what: str, build: str) -> None:
    """Raise :class:`KVCacheMismatchError` unless ``cache`` (a ``KVCache`` or a paged sequence: its
    ``num_layers``, ``num_kv_heads``, ``head_dim``) has the shape ``config``'s model needs; the message
    names the ``what`` and the call that ``build``s the right one."""
    want = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    have = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
    if want != have:
        raise KVCacheMismatchError(
            f"this {what} is shaped (layers, kv_heads, head_dim)={have} but the model needs {want}; build one with "
            f"{build}."
        )
