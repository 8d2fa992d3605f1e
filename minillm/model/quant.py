"""Block formats: how a matrix is stored in fewer bits, byte by byte, and how to get float32 back.

Each format is described once, here, by its byte layout (llama.cpp's ``ggml-common.h`` structs
``block_q8_0``, ``block_q4_0``, ``block_q4_1``, ``block_q5_0``, ``block_q5_1``, ``block_q4_K``,
``block_q5_K``, ``block_q6_K``), with one short dequantization function each. A GGUF matrix
``[rows, cols]`` is ``rows`` runs of ``cols / block_size`` blocks; a block holds ``block_size``
consecutive values of one row. ``d`` is a float16 scale, ``m``/``dmin`` a float16 offset.

    format  values  bytes  bits/weight  layout (bytes, in order)          value
    Q8_0      32     34     8.5         d, qs[32] int8                    d * q
    Q4_0      32     18     4.5         d, qs[16] (2 nibbles each)        d * (q - 8)
    Q4_1      32     20     5.0         d, m, qs[16]                      d * q + m
    Q5_0      32     22     5.5         d, qh[4] (5th bits), qs[16]       d * (q - 16)
    Q5_1      32     24     6.0         d, m, qh[4], qs[16]               d * q + m
    Q4_K     256    144     4.5         d, dmin, scales[12], qs[128]      (d*sc_j) * q - (dmin*m_j)
    Q5_K     256    176     5.5         d, dmin, scales[12], qh[32], qs[128]
    Q6_K     256    210     6.5625      ql[128], qh[64], scales[16] int8, d   (d*sc_j) * (q - 32)

Nibbles: in the 32-value formats, byte ``j`` of ``qs`` holds value ``j`` in its low 4 bits and value
``j + 16`` in its high 4 bits. The K-formats ("super-blocks" of 256) have 8 sub-blocks of 32 (Q4_K,
Q5_K) or 16 of 16 (Q6_K), each with its own small integer scale (and min) relative to ``d`` (``dmin``).

The arithmetic is float32 in the reference's order (``(d * sc) * q - dmin * m``, one rounding per
operation), so the results equal ``gguf.quants.dequantize`` bit for bit (``tests/model/test_quant.py``,
on every tensor of the two shipped GGUF files).

Besides GGUF's blocks, one format minillm makes itself: **int8, symmetric, per output channel**
(one float32 scale per row, ``scale = max|row| / 127``, ``q = round(w / scale)``), the scheme of
LLM.int8()'s vector-wise quantization without its outlier split (Dettmers et al. 2022).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from minillm.errors import WeightsError

QK_K = 256  # values per K-format super-block
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` (even) of every block, as float32 ``[n_blocks, 1]``.

    Every block size is even and every float16 field sits at an even byte, so the blocks are read
    as float16 pairs in place (a view, no copy of the bytes)."""
    return _halves(blocks)[:, start // 2 : start // 2 + 1].astype(np.float32)


def _halves(blocks: np.ndarray) -> np.ndarray:
    """``[n, type_size]`` bytes viewed as ``[n, type_size / 2]`` float16 (a copy only if not contiguous)."""
    return np.ascontiguousarray(blocks).view(np.float16)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Split bytes into 4-bit values: ``[n, k * group]`` bytes -> ``[n, k, 2, group]`` uint8 (low nibbles
    of each run of ``group`` bytes first, then its high nibbles)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group)
    out = np.empty((n, q.shape[1], 2, group), dtype=np.uint8)
    np.bitwise_and(q[:, :, 0], np.uint8(0x0F), out=out[:, :, 0])
    np.right_shift(q[:, :, 0], np.uint8(4), out=out[:, :, 1])
    return out


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit ``i`` of a little-endian 32-bit field ``qh`` ``[n, 4]`` bytes -> ``[n, count]`` uint8 (0 or 1)."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(count, dtype=np.uint32)  # [n, count]
    return (bits & np.uint32(1)).astype(np.uint8)


# The products below write float32 straight from the small integers (``np.multiply(q, d, dtype=...)``
# casts each value exactly on the way), instead of first making a float32 copy of q and then a
# second array for the product: one pass over the output instead of three. Same operations in the
# same order as the reference, so the same bits.


# --- the 32-value formats -------------------------------------------------------------------------
def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 ``[n, 34]`` bytes (d f16, 32 int8) -> float32 ``[n, 32]``: ``q * d``."""
    return np.multiply(blocks[:, 2:].view(np.int8), _f16(blocks, 0), dtype=np.float32)


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 ``[n, 18]`` bytes (d f16, 16 bytes of nibbles) -> float32 ``[n, 32]``: ``d * (q - 8)``."""
    q = _nibbles(blocks[:, 2:], 16).reshape(-1, 32).view(np.int8) - np.int8(8)
    return np.multiply(_f16(blocks, 0), q, dtype=np.float32)


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1 ``[n, 20]`` bytes (d f16, m f16, 16 bytes of nibbles) -> float32 ``[n, 32]``: ``d * q + m``."""
    q = _nibbles(blocks[:, 4:], 16).reshape(-1, 32)
    out = np.multiply(_f16(blocks, 0), q, dtype=np.float32)
    out += _f16(blocks, 2)
    return out


def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 ``[n, 22]`` bytes (d f16, qh u32: bit i = 5th bit of value i, 16 bytes of nibbles) ->
    float32 ``[n, 32]``: ``d * (q - 16)``."""
    q = _nibbles(blocks[:, 6:], 16).reshape(-1, 32) | (_high_bits(blocks[:, 2:6], 32) << np.uint8(4))
    return np.multiply(_f16(blocks, 0), q.view(np.int8) - np.int8(16), dtype=np.float32)


def dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    """Q5_1 ``[n, 24]`` bytes (d f16, m f16, qh u32, 16 bytes of nibbles) -> float32 ``[n, 32]``: ``d * q + m``."""
    q = _nibbles(blocks[:, 8:], 16).reshape(-1, 32) | (_high_bits(blocks[:, 4:8], 32) << np.uint8(4))
    out = np.multiply(_f16(blocks, 0), q, dtype=np.float32)
    out += _f16(blocks, 2)
    return out


# --- the K formats: super-blocks of 256 -----------------------------------------------------------
def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins packed in 12 bytes (``get_scale_min_k4``) -> 2 x ``[n, 8]``.

    Bytes 0-3: scales 0-3 in the low 6 bits; bytes 4-7: mins 0-3 likewise; bytes 8-11: the low 4
    bits of scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the spare top
    bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=1)
    return sc, mn


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K ``[n, 144]`` bytes -> float32 ``[n, 256]``. Bytes: d f16, dmin f16, 12 bytes of 6-bit
    scales/mins, 128 bytes of nibbles (each run of 32 bytes: sub-block 2j in the low nibbles, 2j+1
    in the high). Sub-block j: ``(d * sc_j) * q - dmin * m_j``."""
    n = blocks.shape[0]
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc.astype(np.float32)).reshape(n, 8, 1)
    dm = (_f16(blocks, 2) * mn.astype(np.float32)).reshape(n, 8, 1)
    out = np.multiply(d, _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32), dtype=np.float32)
    out -= dm
    return out.reshape(n, QK_K)


def dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K ``[n, 176]`` bytes -> float32 ``[n, 256]``: Q4_K plus ``qh[32]`` (bytes 16-47) whose bit j
    of byte l is the 5th bit of value l of sub-block j; nibbles in bytes 48-175."""
    n = blocks.shape[0]
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc.astype(np.float32)).reshape(n, 8, 1)
    dm = (_f16(blocks, 2) * mn.astype(np.float32)).reshape(n, 8, 1)
    high = (blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
    q = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32) | (high << np.uint8(4))
    out = np.multiply(d, q, dtype=np.float32)
    out -= dm
    return out.reshape(n, QK_K)


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K ``[n, 210]`` bytes -> float32 ``[n, 256]``. Bytes: ql[128] (low 4 bits), qh[64] (top 2
    bits), 16 int8 scales, d f16. Each half of 128 values uses 64 bytes of ql and 32 of qh: value
    ``32k + l`` (k = 0..3, l = 0..31) has low bits from nibble ``k // 2`` of ``ql[32 (k % 2) + l]`` and
    top bits ``(qh[l] >> 2k) & 3``. Each run of 16 values has its own scale: ``(d * sc) * (q - 32)``."""
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 64).reshape(n, 2, 2, 2, 32)  # [n, half, nibble, k % 2, l]
    low = low.reshape(n, 2, 4, 32)  # [n, half, k = 2 * nibble + k % 2, l]
    top = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (top << np.uint8(4))).view(np.int8) - np.int8(32)  # [n, 2, 4, 32]
    d = np.multiply(_f16(blocks, 208), blocks[:, 192:208].view(np.int8), dtype=np.float32).reshape(n, 16, 1)
    return np.multiply(d, q.reshape(n, 16, 16), dtype=np.float32).reshape(n, QK_K)


def dequantize_f16(blocks: np.ndarray) -> np.ndarray:
    """F16 ``[n, 2]`` bytes -> float32 ``[n, 1]``."""
    return _halves(blocks).astype(np.float32)


def dequantize_bf16(blocks: np.ndarray) -> np.ndarray:
    """BF16 ``[n, 2]`` bytes -> float32 ``[n, 1]``: the 16 bits are float32's top half."""
    return (np.ascontiguousarray(blocks).view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def dequantize_f32(blocks: np.ndarray) -> np.ndarray:
    """F32 ``[n, 4]`` bytes -> float32 ``[n, 1]``."""
    return blocks.copy().view(np.float32)  # a copy: the caller may write to what it gets


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF tensor type: ``block_size`` values stored in ``type_size`` bytes."""

    name: str  # GGUF's GGMLQuantizationType name, e.g. "Q4_1"
    block_size: int
    type_size: int
    dequantize_blocks: Callable[[np.ndarray], np.ndarray]  # uint8 [n, type_size] -> float32 [n, block_size]

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of ``cols`` values."""
        return cols // self.block_size * self.type_size


#: Every format minillm can hold and dequantize; sizes as gguf's ``GGML_QUANT_SIZES``.
BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("F32", 1, 4, dequantize_f32),
        BlockFormat("F16", 1, 2, dequantize_f16),
        BlockFormat("BF16", 1, 2, dequantize_bf16),
        BlockFormat("Q8_0", 32, 34, dequantize_q8_0),
        BlockFormat("Q4_0", 32, 18, dequantize_q4_0),
        BlockFormat("Q4_1", 32, 20, dequantize_q4_1),
        BlockFormat("Q5_0", 32, 22, dequantize_q5_0),
        BlockFormat("Q5_1", 32, 24, dequantize_q5_1),
        BlockFormat("Q4_K", QK_K, 144, dequantize_q4_k),
        BlockFormat("Q5_K", QK_K, 176, dequantize_q5_k),
        BlockFormat("Q6_K", QK_K, 210, dequantize_q6_k),
    )
}


def block_format(type_name: str, tensor: str = "a tensor") -> BlockFormat:
    """The :class:`BlockFormat` named ``type_name``.

    Raises:
        WeightsError: a type minillm cannot dequantize, naming ``tensor`` and its type.
    """
    try:
        return BLOCK_FORMATS[type_name]
    except KeyError:
        raise WeightsError(
            f"tensor {tensor!r} is stored as {type_name}, a block type minillm cannot dequantize "
            f"(it reads {', '.join(BLOCK_FORMATS)}); load with weight_dtype='float32' (converted by "
            "gguf.quants at import), or use a GGUF quantized to one of these types."
        ) from None


def dequantize(data: np.ndarray, type_name: str) -> np.ndarray:
    """Packed rows -> float32: ``data`` uint8 ``[rows, row_bytes]`` (or flat) in format ``type_name``
    -> ``[rows, row_bytes / type_size * block_size]`` (flat in, flat out).

    Raises:
        WeightsError: an unknown type, or a byte count that is not whole blocks.
    """
    fmt = block_format(type_name)
    data = np.asarray(data, dtype=np.uint8)
    if data.shape[-1] % fmt.type_size:
        raise WeightsError(f"{data.shape[-1]} bytes per row is not a whole number of {type_name} blocks")
    values = fmt.dequantize_blocks(data.reshape(-1, fmt.type_size))  # [n_blocks, block_size]
    return values.reshape(*data.shape[:-1], data.shape[-1] // fmt.type_size * fmt.block_size)


# --- int8, symmetric, per output channel ------------------------------------------------------------
QUANTIZE_ROWS_VALUES = 1 << 22  # values quantized at a time (16 MiB of float32 temporaries)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w`` float32 ``[rows, cols]`` -> (``q`` int8 ``[rows, cols]``, ``scale`` float32 ``[rows]``).

    ``scale = max|row| / 127`` (1 for an all-zero row), ``q = round(w / scale)`` in [-127, 127]; each
    value is off by at most ``scale / 2``. One scale per output channel (row of ``[out, in]``),
    so an output's dot product is ``scale * (q_row . x)``.
    """
    w = np.asarray(w, dtype=np.float32)
    q = np.empty(w.shape, dtype=np.int8)
    scale = np.empty(w.shape[0], dtype=np.float32)
    step = max(1, QUANTIZE_ROWS_VALUES // max(1, w.shape[1]))
    for start in range(0, w.shape[0], step):  # in row blocks: no float32 temporary the size of the matrix
        rows = w[start : start + step]
        amax = np.max(np.abs(rows), axis=1)  # [rows]
        scale[start : start + step] = np.where(amax > 0, amax / np.float32(127), np.float32(1))
        q[start : start + step] = np.rint(rows / scale[start : start + step, None])  # |w / scale| <= 127
    return q, scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``q`` int8 ``[rows, cols]``, ``scale`` float32 ``[rows]`` -> float32 ``[rows, cols]``: ``q * scale``."""
    return q.astype(np.float32) * scale[:, None]
