"""Held matrices: every weight matrix behind one interface, however it is kept in memory.

Precision is a property of how a matrix is held, not of the math: the forward pass multiplies
float32 activations by float32 rows either way. What changes is what sits in memory between
tokens, and what each product pays to get float32 rows back::

    weight_dtype   held as                                  float32 rows at use
    float32        Float32Matrix: the float32 array itself  (none: the array itself)
    bfloat16       ml_dtypes.bfloat16 [rows, cols]          top 16 bits of float32 -> shift left 16
    int8           int8 [rows, cols] + float32 scale [rows] q * scale (scale applied after the product)
    gguf           uint8 [rows, row_bytes] in GGUF blocks   quant.dequantize (Q4_1, Q4_K, ...)

Every matrix answers the same calls: ``linear(x)`` (``x @ W.T``), ``take(ids)`` (an embedding
lookup), ``rows(start, stop)``, ``parts()``, ``shape``, ``size``, ``nbytes``, ``format``. A float32
matrix's ``linear`` is the textbook's product on the page, ``x @ w.T``, and its ``dense`` is the
array itself (the engine room's faster formulations of the same product need it; the compact
formats have none). A memory-mapped load's q|k|v (or gate|up) is a :class:`StackedMatrix` of the
file's separate float32 matrices. The compact formats' products run in chunks of rows: dequantize
``CHUNK_VALUES`` values (1 MiB of float32, small enough to stay in the CPU's cache), multiply, move
on. So the float32 copy of a matrix never exists whole (a Gemma 3 LM head would be 640 MiB), and
each chunk is read from the cache while still warm. Even so NumPy writes and re-reads every value
once more than the float32 product does; llama.cpp fuses the dequantization into the dot product
instead (lesson 12 measures both).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from minillm.model import primitives, quant

CHUNK_VALUES = 1 << 18  # values dequantized at a time in a product: 1 MiB of float32


class HeldMatrix:
    """A ``[rows, cols]`` weight matrix, held one way or another. Subclasses give :meth:`rows` (float32 rows)."""

    format: str  # "float32", "bfloat16", "int8", or a GGUF type name ("Q4_1", "Q8_0", ...)
    shape: tuple[int, int]
    #: The float32 array itself, for a product that needs one (``Float32Matrix``); None when the
    #: matrix is held in a compact format (its rows are made at use) or in parts.
    dense: np.ndarray | None = None

    @property
    def size(self) -> int:
        """Number of values (parameters)."""
        return self.shape[0] * self.shape[1]

    @property
    def dtype(self) -> str:
        """The format's name (a string: NumPy has no dtype for a GGUF block)."""
        return self.format

    @property
    def nbytes(self) -> int:  # pragma: no cover - every subclass says
        raise NotImplementedError

    def rows(self, start: int, stop: int) -> np.ndarray:  # pragma: no cover
        """Rows ``start..stop-1`` as float32 ``[stop - start, cols]``."""
        raise NotImplementedError

    def parts(self) -> list[HeldMatrix]:
        """The matrices this one is made of (itself; a :class:`StackedMatrix` lists its parts)."""
        return [self]

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (``[seq]`` ints) as float32 ``[seq, cols]``: an embedding lookup."""
        return np.concatenate([self.rows(int(i), int(i) + 1) for i in ids]) if len(ids) else self.rows(0, 0)

    def linear(self, x: np.ndarray) -> np.ndarray:
        """``x @ W.T``: ``x`` float32 ``[seq, cols]`` -> ``[seq, rows]``, ``CHUNK_VALUES`` at a time."""
        rows, cols = self.shape
        y = np.empty((x.shape[0], rows), dtype=np.float32)  # [seq, rows]
        step = max(1, CHUNK_VALUES // cols)
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            y[:, start:stop] = self._product(x, start, stop)  # [seq, chunk]
        return y

    def _product(self, x: np.ndarray, start: int, stop: int) -> np.ndarray:
        return x @ self.rows(start, stop).T  # [seq, cols] @ [cols, chunk] -> [seq, chunk]

    def to_float32(self) -> np.ndarray:
        """The whole matrix as float32 ``[rows, cols]`` (tests, merging; not what a product uses)."""
        return self.rows(0, self.shape[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.format}, shape={self.shape}, nbytes={self.nbytes:,})"


class Float32Matrix(HeldMatrix):
    """float32 as it is: the ``[rows, cols]`` array (a copy carved at load, or a read-only view of the
    file with ``mmap``), multiplied as it is, ``x @ w.T``. ``np.asarray`` gives the array (no copy)."""

    format = "float32"

    def __init__(self, w: np.ndarray):
        self.dense = w  # [rows, cols] float32
        self.shape = w.shape

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.dense[start:stop]

    def take(self, ids: np.ndarray) -> np.ndarray:
        return self.dense[ids]

    def linear(self, x: np.ndarray) -> np.ndarray:
        return primitives.linear(x, self.dense)  # [seq, cols] @ [cols, rows] -> [seq, rows]

    def to_float32(self) -> np.ndarray:
        return self.dense

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.dense if dtype is None else self.dense.astype(dtype)


class BFloat16Matrix(HeldMatrix):
    """bfloat16 (``ml_dtypes``): float32's sign, exponent and top 7 mantissa bits, 2 bytes a value.

    Made from float32 by rounding to nearest even (``astype``); widened back exactly by shifting the
    16 bits into the top half of a float32."""

    format = "bfloat16"

    def __init__(self, w: np.ndarray):
        self.data = np.ascontiguousarray(w).astype(ml_dtypes.bfloat16)  # [rows, cols]
        self.shape = self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def rows(self, start: int, stop: int) -> np.ndarray:
        bits = self.data[start:stop].view(np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32)

    def take(self, ids: np.ndarray) -> np.ndarray:
        return (self.data[ids].view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


class Int8Matrix(HeldMatrix):
    """int8 symmetric per output channel (``quant.quantize_int8``): ``q`` int8 + float32 ``scale`` per row.

    In a product the scale is applied to the outputs, ``y = (x @ q.T) * scale``, which is the same
    sum as ``x @ (q * scale).T`` with one multiply per output instead of one per weight."""

    format = "int8"

    def __init__(self, w: np.ndarray):
        self.q, self.scale = quant.quantize_int8(w)  # [rows, cols] int8, [rows] float32
        self.shape = self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def rows(self, start: int, stop: int) -> np.ndarray:
        return quant.dequantize_int8(self.q[start:stop], self.scale[start:stop])

    def take(self, ids: np.ndarray) -> np.ndarray:
        return quant.dequantize_int8(self.q[ids], self.scale[ids])

    def _product(self, x: np.ndarray, start: int, stop: int) -> np.ndarray:
        return (x @ self.q[start:stop].astype(np.float32).T) * self.scale[start:stop]


class BlockMatrix(HeldMatrix):
    """A GGUF tensor's blocks as read from the file: ``data`` uint8 ``[rows, row_bytes]``, each row
    ``cols / block_size`` blocks of the format ``type_name`` (``quant.BLOCK_FORMATS``)."""

    def __init__(self, data: np.ndarray, type_name: str, cols: int, name: str = "a tensor"):
        self.block = quant.block_format(type_name, name)
        self.format = type_name
        if cols % self.block.block_size or data.shape[1] != self.block.row_bytes(cols):
            raise ValueError(f"{name}: {data.shape[1]} bytes per row do not hold {cols} {type_name} values")
        self.data = data
        self.shape = (data.shape[0], cols)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def rows(self, start: int, stop: int) -> np.ndarray:
        return quant.dequantize(self.data[start:stop], self.format)

    def take(self, ids: np.ndarray) -> np.ndarray:
        return quant.dequantize(self.data[ids], self.format)


class StackedMatrix(HeldMatrix):
    """Matrices stacked along rows (q | k | v, gate | up), each held in its own format: a GGUF may
    store q and v in different block types. ``linear`` runs each part and concatenates."""

    def __init__(self, parts: list[HeldMatrix]):
        self._parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.format = "+".join(dict.fromkeys(p.format for p in parts))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._parts)

    def parts(self) -> list[HeldMatrix]:
        return list(self._parts)

    def rows(self, start: int, stop: int) -> np.ndarray:
        out, offset = [], 0
        for p in self._parts:
            a, b = max(start - offset, 0), min(stop - offset, p.shape[0])
            if a < b:
                out.append(p.rows(a, b))
            offset += p.shape[0]
        return np.concatenate(out) if out else np.zeros((0, self.shape[1]), np.float32)

    def linear(self, x: np.ndarray) -> np.ndarray:
        return np.concatenate([p.linear(x) for p in self._parts], axis=-1)  # [seq, rows]


#: weight_dtype -> how a float32 matrix is held.
HOLDERS = {"float32": Float32Matrix, "bfloat16": BFloat16Matrix, "int8": Int8Matrix}


def hold(w: HeldMatrix, weight_dtype: str) -> HeldMatrix:
    """A float32 matrix ``w`` held at ``weight_dtype`` (``"float32"``: ``w`` itself)."""
    return w if weight_dtype == w.format else HOLDERS[weight_dtype](w.to_float32())
