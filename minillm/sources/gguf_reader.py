"""Reading a GGUF file: its header and metadata, and one tensor at a time in this machine's byte order.

Two readers: gguf's ``GGUFReader`` (:func:`read_gguf`, every field, for the conversion) and
:func:`scan_gguf`, a header scan that skips the big arrays (for running from the GGUF itself).
Byte order: a GGUF says its byte order by how its version number reads; :func:`read_tensor` turns
plain numbers into this machine's order and refuses packed block data in a big-endian file.
"""

from __future__ import annotations

import pathlib
import struct
from typing import Any

import numpy as np

from minillm.errors import GGUFError

GGUF_MAGIC = b"GGUF"


# --- reading ------------------------------------------------------------------------------------
def read_gguf(path: pathlib.Path) -> tuple[Any, dict[str, Any]]:
    """(GGUFReader, metadata dict) after checking the file exists and starts with b"GGUF".

    Every failure is a GGUFError: missing file, wrong magic, truncated or corrupt contents.
    """
    reader = _open_gguf(path)
    try:
        return reader, {name: _field_value(f) for name, f in reader.fields.items()}
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, OSError) as exc:
        raise unreadable(path, exc) from exc


def _open_gguf(path: pathlib.Path):
    """A ``gguf.GGUFReader`` on ``path``, after checking it exists and starts with b"GGUF"."""
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}; check the path, or fetch the model again")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(
            f"{path} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}; "
            "pass a .gguf file (a partial download or an HTML error page looks like this)"
        )
    import gguf

    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, OSError) as exc:
        raise unreadable(path, exc) from exc


def unreadable(path: pathlib.Path, exc: Exception) -> GGUFError:
    import gguf

    # The reader memory-maps the file and slices it by the sizes in its header, so a short file
    # shows up as a NumPy reshape/view error; say what it means instead.
    return GGUFError(
        f"cannot read GGUF {path} ({path.stat().st_size:,} bytes): {exc}. The file is probably "
        "truncated or corrupt (download it again and check its sha256), or uses a GGUF feature "
        f"newer than gguf {getattr(gguf, '__version__', '')} knows (pip install -U gguf)"
    )


def _field_value(field_) -> Any:
    value = field_.contents()
    if isinstance(value, float):
        # GGUF stores floats as float32; keep the shortest float32 decimal (1e-05, not 9.9999997e-06)
        return float(str(np.float32(value)))
    return value


# Tensor types stored as plain numbers: read with the file's byte order, then widened to float32.
_NUMBER_TYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


def is_big_endian(reader) -> bool:
    """True if the GGUF was written big-endian (gguf's reader tells from the version field)."""
    import gguf

    return reader.endianess == gguf.GGUFEndian.BIG


def read_tensor(reader, t, path: pathlib.Path | None = None) -> np.ndarray:
    """One GGUF tensor as float32 in this machine's byte order, shaped as the file stores it
    (gguf's reader shape; ``gguf_import.convert_tensors`` reshapes to HF's ``[out, in]``).

    Plain number types (F32, F16, F64, I8..I64) are read in the file's byte order, whatever it
    is; block-quantized types and BF16 are dequantized with ``gguf.quants`` from a little-endian
    file. Raises GGUFError for packed data in a big-endian file (never read silently wrong).
    """
    kind = t.tensor_type.name
    if kind in _NUMBER_TYPES:
        # gguf's reader views these with the file's byte order (e.g. '>f4'); astype converts the
        # *values* to native float32. (gguf.quants.dequantize would reinterpret the bytes instead.)
        native = np.dtype(_NUMBER_TYPES[kind]).newbyteorder("=")
        return np.asarray(t.data).astype(native).astype(np.float32)
    if is_big_endian(reader):
        name = path.name if path is not None else "the GGUF"
        raise GGUFError(
            f"{name} is big-endian and tensor {t.name} is {kind}: packed block data (its fp16 scales) has no "
            "byte order gguf can state, so it cannot be read safely; convert the model little-endian "
            "(llama.cpp's convert_hf_to_gguf.py without --bigendian), or big-endian as F32/F16"
        )
    return dequantize_rows(t.data, t.tensor_type)


def dequantize_rows(data: np.ndarray, qtype, rows_per_chunk: int = 4096) -> np.ndarray:
    """``gguf.quants.dequantize(data, qtype)`` as float32, a few thousand rows at a time.

    ``data`` is the packed uint8 ``[rows, row_bytes]`` (or 1-D) of a block-quantized tensor; the
    result is float32 ``[rows, row_values]``, the same bits as one call (blocks are independent).
    Why in chunks: one call over a large matrix holds several float32 temporaries of the whole
    matrix at once (Gemma 3's 262,144-row embedding), which set the conversion's peak memory.
    """
    import gguf

    data = np.asarray(data)
    if data.ndim < 2 or data.shape[0] <= rows_per_chunk:
        return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)
    first = np.asarray(gguf.quants.dequantize(data[:rows_per_chunk], qtype), dtype=np.float32)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
    out[:rows_per_chunk] = first
    for start in range(rows_per_chunk, data.shape[0], rows_per_chunk):
        out[start : start + rows_per_chunk] = gguf.quants.dequantize(data[start : start + rows_per_chunk], qtype)
    return out


def check_tensor_types(path: pathlib.Path, reader) -> None:
    """Fail before any work if a tensor type cannot be read: gguf.quants has no dequantizer for it,
    or it is packed data in a big-endian file (see :func:`read_tensor`)."""
    import gguf

    for qtype in sorted({t.tensor_type for t in reader.tensors}):
        if qtype.name in _NUMBER_TYPES:
            continue
        if is_big_endian(reader):
            read_tensor(reader, next(t for t in reader.tensors if t.tensor_type == qtype), path)  # raises
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:  # one all-zero block is enough to learn whether a dequantizer exists
            gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
        except NotImplementedError:
            names = [t.name for t in reader.tensors if t.tensor_type == qtype]
            raise GGUFError(
                f"{path.name}: tensor {names[0]} ({len(names)} tensor(s)) has type {qtype.name}, "
                "which gguf.quants cannot dequantize; use a GGUF quantized as F32/F16/BF16/Q4_K/Q8_0 "
                "or similar, or upgrade the gguf package"
            ) from None


# GGUF value types (gguf's GGUFValueType): struct format per scalar type; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def scan_gguf(path: pathlib.Path) -> tuple[dict[str, Any], list[tuple[str, int, tuple[int, ...], int]], int]:
    """Read a GGUF header without the big arrays: (scalar and string metadata, tensor infos
    ``(name, type id, dims fastest first, offset)``, where the tensor data starts).

    The layout (ggml's ``docs/gguf.md``): magic, version u32, tensor count u64, key/value count u64;
    each key/value: string key, type u32, value; each tensor: string name, n_dims u32, dims u64,
    type u32, offset u64; the data after, aligned to ``general.alignment`` (32 by default). Strings
    are u64 length + UTF-8; arrays are element type u32 + count u64 + elements (skipped here:
    ``gguf.GGUFReader`` makes Python objects of Gemma's 262,144 token strings, 25 s of a load).
    """
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file; pass a .gguf file")
    pos = 4
    raw = memoryview(np.memmap(path, dtype=np.uint8, mode="r"))  # the header can be megabytes (the vocabulary)

    def unpack(fmt: str):
        nonlocal pos
        value = struct.unpack_from("<" + fmt, raw, pos)[0]
        pos += struct.calcsize("<" + fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = unpack("Q")
        pos += n
        return bytes(raw[pos - n : pos]).decode("utf-8")

    def skip(type_id: int) -> None:
        nonlocal pos
        if type_id == 8:
            n = unpack("Q")  # read before `pos +=`: unpack moves pos itself
            pos += n
        elif type_id == 9:
            inner, count = unpack("I"), unpack("Q")
            if inner in _SCALARS:
                pos += count * struct.calcsize("<" + _SCALARS[inner])
            else:
                for _ in range(count):
                    skip(inner)
        else:
            pos += struct.calcsize("<" + _SCALARS[type_id])

    unpack("I")  # version
    n_tensors, n_kv = unpack("Q"), unpack("Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key, type_id = string(), unpack("I")
        if type_id == 8:
            meta[key] = string()
        elif type_id in _SCALARS:
            meta[key] = unpack(_SCALARS[type_id])
        else:
            skip(type_id)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = string(), unpack("I")
        dims = tuple(unpack("Q") for _ in range(n_dims))
        infos.append((name, unpack("I"), dims, unpack("Q")))
    align = int(meta.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    return meta, infos, data_start
