"""Safetensors files, read with the ``safetensors`` library, one tensor at a time.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length ``n``,
``n`` bytes of JSON (``{name: {"dtype", "shape", "data_offsets": [start, end]}}``, plus an optional
``__metadata__``), then the raw little-endian data. ``safetensors`` checks all of it (the header's
length and JSON, byte ranges that tile the data section exactly) and hands each tensor to NumPy.

NumPy has no bfloat16; ``ml_dtypes`` (the NumPy dtype extensions JAX uses) registers one, so a
bfloat16 tensor arrives as a NumPy array and widens to float32 exactly: a bfloat16 is the top half
of a float32.

Each tensor is read in its own ``safe_open``: the library memory-maps the file, and mapped pages
count in the process's resident set while the map lives, so one map held open over the whole
load made the peak twice the weights.

A model folder may hold one file or shards listed in ``model.safetensors.index.json``
(:func:`weight_files`). ``weights.py`` turns the tensors into the model's layout.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, so safetensors can hand it over)
import numpy as np
from safetensors import SafetensorError, safe_open

from minillm.errors import WeightsError

_DTYPES = {  # safetensors dtype -> (bytes per element, name shown in the trace): what minillm reads
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F64": (8, "float64"),
}


@dataclass
class StoredTensor:
    """One tensor as a safetensors file holds it: where, what dtype, what shape. Read on demand."""

    file: Path
    name: str
    dtype: str  # safetensors name: "F32", "BF16", ...
    shape: tuple[int, ...]

    def to_float32(self) -> np.ndarray:
        """The values as a float32 array of ``shape`` (a fresh, writable array; exact for every
        dtype we read but F64, which is rounded).

        Raises:
            WeightsError: a dtype minillm does not read (integers, 8-bit floats, ...), or the file
                changed since its header was read.
        """
        if self.dtype not in _DTYPES:
            raise WeightsError(
                f"{self.file.name} stores this tensor as {self.dtype}; minillm reads "
                f"{', '.join(_DTYPES)}. Convert the checkpoint to one of those."
            )
        try:
            with safe_open(self.file, framework="numpy") as f:
                values = f.get_tensor(self.name)  # a copy out of the map, in the stored dtype
        except (SafetensorError, OSError) as exc:
            raise _unreadable(self.file, exc) from None
        return values.astype(np.float32, copy=False)  # F32: already it; F16/BF16: exact; F64: rounded

    def mapped(self, maps: dict) -> np.ndarray:
        """The values as a read-only float32 view of the file, memory-mapped: no byte is read
        until the forward touches it (the kernel pages it in then, and may drop it again under
        memory pressure: it is the file's page cache, not the process's own memory).

        Raises:
            WeightsError: the tensor is not float32 (a mapped view cannot be converted; load
                without ``mmap=True``, or convert the checkpoint to float32).
        """
        if self.dtype != "F32":
            raise WeightsError(
                f"{self.file.name} stores tensor {self.name!r} as {dtype_name(self.dtype)}; a memory-mapped "
                "load (mmap=True) uses the file's bytes as they are, so it needs float32 tensors. Load "
                "without mmap=True (the tensors are converted to float32 in memory), or save the "
                "checkpoint as float32."
            )
        if self.file not in maps:  # one map per file and load; the views keep it alive, nothing else does
            maps[self.file] = _mapping(self.file)
        mm, offsets = maps[self.file]
        return np.ndarray(self.shape, dtype=np.float32, buffer=mm, offset=offsets[self.name])


def _mapping(file: Path) -> tuple[np.memmap, dict[str, int]]:
    """A read-only map of the file, and each tensor's byte offset in it (from the header)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")  # the header's length; safetensors checked it
        header = json.loads(f.read(n))
    offsets = {k: 8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    return np.memmap(file, dtype=np.uint8, mode="r"), offsets


def _unreadable(file: Path, exc: Exception) -> WeightsError:
    return WeightsError(f"cannot read {file}: {exc}; the file is corrupt or truncated. Re-download it.")


def read_safetensors_header(file: Path) -> dict[str, StoredTensor]:
    """One ``.safetensors`` file's tensors: ``{name: StoredTensor}``, no tensor data read yet.

    Raises:
        WeightsError: the file is truncated or corrupt (``safetensors``' reason in the message:
            a header longer than the file, a header that is not JSON, byte ranges that do not
            tile the data or do not match a tensor's shape and dtype).
    """
    try:
        with safe_open(file, framework="numpy") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {name: StoredTensor(file, name, s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}
    except (SafetensorError, OSError) as exc:
        raise _unreadable(file, exc) from None


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
                raise WeightsError(
                    f"{index} names shard {name!r}, a path outside the model folder {folder}; "
                    "refusing to read it. A shard index may only name files inside the folder."
                )
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
        raise WeightsError(
            f"no *.safetensors weights in {folder}; download the model's weights "
            "(model.safetensors, or the shards and model.safetensors.index.json)."
        )
    return files


def dtype_name(dtype: str) -> str:
    """The trace's name for a safetensors dtype: ``BF16`` -> ``bfloat16``."""
    return _DTYPES[dtype][1] if dtype in _DTYPES else dtype.lower()


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype."""
    if dtype in _DTYPES:
        return _DTYPES[dtype][0]
    return {"I64": 8, "U64": 8, "F64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2}.get(dtype, 1)
