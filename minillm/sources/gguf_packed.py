"""A GGUF's tensors kept packed, by Hugging Face name: the weights of ``weight_dtype="gguf"``.

Read with the header scan (no Python object per token string), each tensor copied once out of a
read-only map of the file, llama-family q/k rows gathered in HF's order as they are copied.
"""

from __future__ import annotations

import os
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from minillm.errors import GGUFError
from minillm.sources.gguf_families import ARCHITECTURES, plan_tensors, unpermute_rope_rows
from minillm.sources.gguf_reader import dequantize_rows, scan_gguf, unreadable


@dataclass
class PackedTensor:
    """One GGUF tensor as stored, under its Hugging Face name: its blocks kept packed.

    ``data`` is uint8 ``[rows, row_bytes]`` in the tensor's GGUF type ``type_name`` (``"Q4_1"``,
    ``"F32"``, ...), ``shape`` the HF ``[out, in]`` (or ``[dim]``) shape of its values. Rows of
    llama-family q/k are already put back in HF's order: blocks run along a row, so moving whole
    packed rows is exact. The bytes are a copy, not a view of the memory-mapped file.
    """

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 [rows, row_bytes]
    norm_shift: float = 0.0  # subtract from the values to get HF's (Gemma's norms: 1 + w -> w)

    def to_float32(self) -> np.ndarray:
        """The values as float32 in ``shape``, computed as ``import_gguf`` writes them (the same bits)."""
        import gguf

        qtype = gguf.GGMLQuantizationType[self.type_name]
        w = dequantize_rows(self.data, qtype).reshape(self.shape)
        if self.norm_shift:
            w -= np.float32(self.norm_shift)
        return w


def read_packed_tensors(gguf_path: str | os.PathLike) -> tuple[dict[str, PackedTensor], str]:
    """Every tensor of a GGUF file, packed, by Hugging Face name; and the file's architecture.

    Raises:
        GGUFError: not a GGUF, truncated, an unsupported architecture, or a tensor without an HF name.
    """
    import gguf

    path = pathlib.Path(gguf_path)
    try:
        meta, infos, data_start = scan_gguf(path)
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise unreadable(path, exc) from exc
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path.name}: architecture {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})")
    spec = ARCHITECTURES[arch]
    n_heads = meta[f"{arch}.attention.head_count"]
    heads = {
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", n_heads),
    }
    # One owned copy per tensor, taken from a read-only map of the file: q/k rows are gathered in
    # HF's order as they are copied (a second copy, freed after, would stay in the heap as holes).
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, type_id, dims, offset in infos:
        qtype = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(dims[1:], dtype=np.int64))  # GGUF dims are fastest first: [in, out]
        row_bytes = dims[0] // block * type_size
        start = data_start + offset
        if start + rows * row_bytes > mm.size:
            raise GGUFError(f"{path.name}: tensor {name!r} runs past the end of the file; it is truncated")
        tensors.append(_TensorInfo(name, qtype, dims, mm[start : start + rows * row_bytes].reshape(rows, row_bytes)))
    out = {}
    for t, hf_name, local in plan_tensors(
        path, spec, _Tensors(tensors), {"num_hidden_layers": meta[f"{arch}.block_count"]}
    ):
        shape = tuple(reversed(t.shape))  # [out, in] (or [dim])
        if local in spec.rope_permuted:
            order = unpermute_rope_rows(np.arange(len(t.data))[:, None], heads[spec.rope_permuted[local]])[:, 0]
            data = np.asarray(t.data[order])  # HF row i is GGUF row order[i]
        else:
            data = np.array(t.data)
        shift = spec.norm_shift if t.name.endswith("norm.weight") else 0.0
        out[hf_name] = PackedTensor(name=t.name, type_name=t.tensor_type.name, shape=shape, data=data, norm_shift=shift)
    del tensors, mm
    return out, arch


@dataclass
class _TensorInfo:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest first
    data: np.ndarray  # uint8 [rows, row_bytes]


@dataclass
class _Tensors:
    tensors: list[_TensorInfo]
