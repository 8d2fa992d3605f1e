"""The weights' bytes at ``weight_dtype="gguf"``, from a GGUF file's header alone.

At ``gguf`` the matrices stay as the file packs them (``model/gguf_weights.py``), each in its own
block type, so the config cannot say their size: the header can. Its tensor table gives every
tensor's type and shape; a matrix of ``rows x cols`` in a block format of ``block_size`` values in
``type_size`` bytes holds ``rows * cols / block_size * type_size`` bytes (``quant.BlockFormat``),
and a norm is widened to float32 at load (``n * 4``). Only the header is read (a memory map's first
pages), never the tensor data.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from minillm.model.config import ModelConfig
from minillm.model.quant import block_format


def gguf_weight_bytes(gguf_path: str | os.PathLike, config: ModelConfig) -> dict[str, int]:
    """``{format: bytes}`` as ``load(..., weight_dtype="gguf")`` holds the file's weights.

    Matrices (2-D tensors) under their GGUF type name (``"Q8_0"``, ``"Q4_K"``, ...); norms (1-D)
    under ``"float32"``. A tied model's ``output.weight``, if the file carries one, is not held
    (the embedding is the head). Equal to ``Weights.formats()`` after such a load.

    Raises:
        GGUFError: not a GGUF file.
        WeightsError: a block type minillm cannot dequantize (naming the tensor).
    """
    import gguf

    from minillm.sources.gguf_reader import scan_gguf

    _, infos, _ = scan_gguf(Path(gguf_path))
    out: Counter = Counter()
    for name, type_id, dims, _offset in infos:
        if config.tie_word_embeddings and name == "output.weight":
            continue
        if len(dims) == 1:
            out["float32"] += 4 * int(dims[0])
            continue
        cols, rows = int(dims[0]), int(dims[1])  # GGUF order: fastest first
        type_name = gguf.GGMLQuantizationType(type_id).name
        out[type_name] += rows * block_format(type_name, name).row_bytes(cols)
    return dict(out)
