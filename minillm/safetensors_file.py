"""Safetensors files, read by hand: the header says where each tensor's bytes are; we map them.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length ``n``,
``n`` bytes of JSON (``{name: {"dtype", "shape", "data_offsets": [start, end]}}``, plus an optional
``__metadata__``), then the raw little-endian data. Reading it ourselves (instead of
``safetensors.numpy``) lets us read bfloat16, which NumPy has no dtype for: a bfloat16 is the top
half of a float32, so ``uint32(word) << 16`` reinterpreted as float32 is its exact value.

A model folder may hold one file or shards listed in ``model.safetensors.index.json``
(:func:`weight_files`). ``weights.py`` turns the tensors into the model's layout.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import WeightsError

_DTYPES = {  # safetensors dtype -> (NumPy dtype of the stored words, name shown in the trace)
    "F32": (np.dtype("<f4"), "float32"),
    "F16": (np.dtype("<f2"), "float16"),
    "BF16": (np.dtype("<u2"), "bfloat16"),  # no NumPy bfloat16: keep the raw 16-bit words
    "F64": (np.dtype("<f8"), "float64"),
}


@dataclass
class StoredTensor:
    """One tensor as a safetensors file holds it: where, what dtype, what shape. Read on demand."""

    file: Path
    dtype: str  # safetensors name: "F32", "BF16", ...
    shape: tuple[int, ...]
    offset: int  # where the raw bytes start in the file
    readable: bool  # False for a dtype we cannot read

    def to_float32(self) -> np.ndarray:
        """The values as a float32 array of ``shape`` (a fresh copy, exact for every dtype we read).

        Raises WeightsError for a dtype minillm does not read (integers, 8-bit floats, ...).
        """
        if not self.readable:
            raise WeightsError(f"{self.file.name} stores this tensor as {self.dtype}; minillm reads "
                               f"{', '.join(_DTYPES)}. Convert the checkpoint to one of those.")
        # A plain read into fresh memory, not a memory map: mapped file pages count in the resident
        # set while the map lives, so mapping the file made the load peak at twice the weights.
        dtype = _DTYPES[self.dtype][0]
        count = int(np.prod(self.shape, dtype=np.int64))
        words = np.fromfile(self.file, dtype=dtype, count=count, offset=self.offset).reshape(self.shape)
        if self.dtype == "BF16":
            # bfloat16 = the high 16 bits of a float32: put them back there, exactly.
            return (words.astype(np.uint32) << 16).view(np.float32)
        return words.astype(np.float32, copy=False)  # F32: already the array; F16/F64: exact/rounded


def read_safetensors_header(file: Path) -> dict[str, StoredTensor]:
    """Map one ``.safetensors`` file: ``{name: StoredTensor}``, no tensor data read yet.

    The format: 8 bytes little-endian header length ``n``, ``n`` bytes of JSON (``{name: {"dtype",
    "shape", "data_offsets": [start, end]}}``, plus ``__metadata__``), then the raw data.

    Raises:
        WeightsError: the file is truncated, the header is not valid JSON, or a tensor's byte
            range is outside the file or does not match its shape and dtype.
    """
    def corrupt(why: str) -> WeightsError:
        return WeightsError(f"cannot read {file}: {why}; the file is corrupt or truncated. Re-download it.")

    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise corrupt(f"only {size} bytes")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise corrupt(f"the header claims {n:,} bytes but the file has {size:,}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise corrupt(f"the header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    data_len = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if not all(type(v) is int and v >= 0 for v in (*shape, start, end)) or not isinstance(dtype, str):
                raise ValueError("shape and data_offsets must be whole numbers >= 0")
        except (KeyError, TypeError, ValueError) as exc:
            raise corrupt(f"tensor {name!r} has a malformed entry {info!r}") from exc
        if not start <= end <= data_len:
            raise corrupt(f"tensor {name!r} lies at bytes {start}..{end} of a {data_len:,}-byte data section")
        known = _DTYPES.get(dtype)
        if known is not None and (end - start) != int(np.prod(shape, dtype=np.int64)) * known[0].itemsize:
            raise corrupt(f"tensor {name!r} has {end - start} bytes, not {shape} x {dtype}")
        out[name] = StoredTensor(file, dtype, shape, 8 + n + start, known is not None)
    return out


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model folder: the shards named by
    ``model.safetensors.index.json`` if present, else every ``*.safetensors``.

    Raises:
        WeightsError: no safetensors file; only pickle files (``.bin``/``.pt``), which minillm
            never loads because unpickling runs code; an index naming a missing shard or a path
            outside the folder.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError('"weight_map" must map tensor names to shard file names')
            shard_names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
            raise WeightsError(f"{index} is not a valid shard index ({exc}); re-download the model.") from exc
        files = []
        for name in shard_names:
            # A shard is a file *in* this folder: no absolute path, no '..' (symlinks the folder
            # itself holds, as in a Hugging Face cache snapshot, are the folder's own business).
            parts = name.replace("\\", "/").split("/")
            if not name or name.startswith(("/", "\\")) or ":" in parts[0] or ".." in parts:
                raise WeightsError(f"{index} names shard {name!r}, a path outside the model folder {folder}; "
                                   "refusing to read it. A shard index may only name files inside the folder.")
            path = folder / name
            if not path.is_file():
                raise WeightsError(f"{index} names shard {name!r}, which is missing from {folder}; re-download it.")
            files.append(path)
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if pickles:
            raise WeightsError(
                f"{folder} has only pickle weights ({', '.join(pickles)}); minillm never unpickles "
                "(it can run code). Convert them to safetensors or download the safetensors files."
            )
        raise WeightsError(f"no *.safetensors weights in {folder}; download the model's weights "
                           "(model.safetensors, or the shards and model.safetensors.index.json).")
    return files


def dtype_name(dtype: str) -> str:
    """The trace's name for a safetensors dtype: ``BF16`` -> ``bfloat16``."""
    return _DTYPES[dtype][1] if dtype in _DTYPES else dtype.lower()


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype."""
    if dtype in _DTYPES:
        return _DTYPES[dtype][0].itemsize
    return {"I64": 8, "U64": 8, "F64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2}.get(dtype, 1)
