"""Weights straight from a GGUF file, its blocks kept packed (``load(..., weight_dtype="gguf")``).

The float32 folder minillm converts a GGUF into holds 4 bytes a weight; the GGUF itself holds
what its blocks take (Q4_1: 5 bits a weight). Here each matrix stays as the file stores it, a
:class:`~minillm.model.held.BlockMatrix`, and ``quant.py`` turns its rows into float32 right
before each product: the same numbers as the converted folder, in a quarter of the memory or less.

What stays float32: the norms (GGUF stores them as F32; Gemma's ``1 + w`` handled as at import).
What stays packed: every projection, the embedding (SmolLM2: Q8_0; Gemma 3: Q8_0) and an untied
LM head. q|k|v and gate|up are stacked without repacking, since a GGUF may give each its own type.
llama.cpp's permutation of the llama family's q/k rows is undone on whole packed rows
(``sources.gguf_packed.read_packed_tensors``).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import numpy as np

from minillm.errors import WeightsError
from minillm.model.config import ModelConfig
from minillm.model.families import NAME_MAPS, NormKind, PositionKind
from minillm.model.held import BlockMatrix, StackedMatrix
from minillm.model.weights import Weights, read_parameters
from minillm.sources.gguf_packed import read_packed_tensors


def load_gguf_weights(gguf_path: str | os.PathLike, config: ModelConfig) -> Weights:
    """Read a GGUF's tensors into :class:`Weights` with every matrix a packed :class:`BlockMatrix`.

    ``config`` is the model's (from the folder converted from this GGUF). Returns Weights with
    ``weight_dtype="gguf"``; ``stored_dtypes``/``stored_bytes`` count parameters and bytes per GGUF type.

    Raises:
        WeightsError: a tensor missing or of the wrong shape, a block type minillm cannot dequantize
            (naming the tensor and its type), or a model with biases or learned positions (no GGUF
            architecture minillm reads has them).
        GGUFError: not a GGUF file, or an architecture minillm does not read.
    """
    path = Path(gguf_path)
    if config.qkv_bias or config.o_bias or config.mlp_bias or config.position_embedding is PositionKind.LEARNED:
        raise WeightsError(f"{path.name}: weight_dtype='gguf' reads llama and gemma3 GGUFs (no biases)")
    t0 = time.perf_counter()
    tensors, _ = read_packed_tensors(path)
    t1 = time.perf_counter()
    r = _PackedReader(path, config, tensors)
    if config.norm is not NormKind.RMSNORM:
        raise WeightsError(f"{path.name}: weight_dtype='gguf' expects RMSNorm models")
    parameters = read_parameters(r, config)  # the safetensors load's own builder, through the packed reader
    return Weights(
        **parameters,
        stored_dtypes=r.counts,
        stored_bytes=r.nbytes,
        unused_tensors=sorted(set(tensors) - r.used),
        files=[path],
        seconds={"read": t1 - t0, "convert": time.perf_counter() - t1},
        weight_dtype="gguf",
    )


class _PackedReader:
    """A GGUF's packed tensors by the family's key (``NAME_MAPS``), each checked against its shape and
    counted (parameters and bytes per GGUF type) as it is taken: the reader interface of
    ``weights.read_parameters`` (as ``tensor_reader.TensorReader``), with every matrix a BlockMatrix."""

    omits_tied_head = True  # llama.cpp leaves output.weight out when the head is the embedding

    def __init__(self, path: Path, config: ModelConfig, tensors: dict):
        self.path, self.config, self.tensors = path, config, tensors
        self.names = NAME_MAPS[config.family]
        self.counts: Counter = Counter()
        self.nbytes: Counter = Counter()
        self.used: set[str] = set()

    def find(self, key: str, i: int | None) -> str | None:
        """The file's name for ``key`` in layer ``i``, or None when the GGUF has no such tensor."""
        name = self.names[key].format(i=i)
        return name if name in self.tensors else None

    def get(self, key: str, shape: tuple[int, ...], i: int | None = None):
        """The packed tensor of ``key`` (layer ``i``). Raises WeightsError: missing, or not of ``shape``."""
        name = self.names[key].format(i=i)
        if name not in self.tensors:
            raise WeightsError(f"tensor {name!r} is missing from {self.path.name}; the GGUF does not match config.json")
        t = self.tensors[name]
        if t.shape != shape:
            raise WeightsError(f"tensor {t.name!r} in {self.path.name} has shape {t.shape}, expected {shape}")
        self.used.add(name)
        self.counts[t.type_name] += int(np.prod(shape))
        self.nbytes[t.type_name] += t.data.nbytes
        return t

    def table(self, key: str, rows: int, cols: int) -> BlockMatrix:
        """A ``[rows, cols]`` matrix (the embedding, an untied head), its blocks kept packed."""
        t = self.get(key, (rows, cols))
        return BlockMatrix(t.data, t.type_name, cols, t.name)

    def matrix(self, i: int, in_dim: int, *pieces: tuple[str, int]) -> BlockMatrix | StackedMatrix:
        """Layer ``i``'s projection stacking ``pieces`` ``(key, out_dim)`` row-wise, ``[sum out, in_dim]``:
        one packed matrix, or several stacked without repacking (each keeps its own GGUF type)."""
        held = []
        for key, out_dim in pieces:
            t = self.get(key, (out_dim, in_dim), i)
            held.append(BlockMatrix(t.data, t.type_name, in_dim, t.name))
        return held[0] if len(held) == 1 else StackedMatrix(held)

    def take(self, key: str, shape: tuple[int, ...], i: int | None = None) -> np.ndarray:
        """A small tensor (a norm's weight) as float32."""
        return self.get(key, shape, i).to_float32()

    def maybe(self, cond: bool, key: str, shape: tuple[int, ...], i: int | None = None) -> np.ndarray | None:
        """:meth:`take` if ``cond`` (the config says the family has this tensor), else None."""
        return self.take(key, shape, i) if cond else None

    def norm(self, key: str, dim: int, i: int | None = None) -> np.ndarray:
        """A norm's float32 ``[dim]`` weight, as the converted folder holds it (Gemma: w, not 1 + w),
        then with the family's offset added as the safetensors reader does (``1 + w``)."""
        w = self.take(key, (dim,), i)
        if self.config.norm_weight_offset:
            w = w + np.float32(self.config.norm_weight_offset)
        return w
