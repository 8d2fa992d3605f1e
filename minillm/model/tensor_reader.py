"""Reading a checkpoint's tensors into the internal layout: one at a time, checked, timed.

``weights.load_weights`` asks a :class:`TensorReader` for each tensor by its family-independent key
(``"q"``, ``"attn_norm"``, ...; ``families.NAME_MAPS`` names them per family) and gets it in
minillm's layout: ``[out, in]`` projections, fused rows carved from one :class:`WeightBlock`, norms
with Gemma's ``1 +`` folded in. Every shape is checked against config.json as it is taken.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import numpy as np

from minillm.errors import WeightsError
from minillm.model.config import ModelConfig
from minillm.model.families import CONV1D_FAMILIES, NAME_MAPS, OPTIONAL_PREFIX
from minillm.model.held import Float32Matrix, StackedMatrix
from minillm.sources.safetensors_file import StoredTensor, dtype_name, itemsize, read_safetensors_header


def read_tensors(files: list[Path]) -> tuple[dict[str, StoredTensor], Counter, Counter]:
    """Map every tensor of every file, counting parameters and bytes per stored dtype."""
    tensors: dict[str, StoredTensor] = {}
    counts: Counter = Counter()
    nbytes: Counter = Counter()
    for file in files:
        for name, t in read_safetensors_header(file).items():
            n = int(np.prod(t.shape, dtype=np.int64))
            counts[dtype_name(t.dtype)] += n
            nbytes[dtype_name(t.dtype)] += n * itemsize(t.dtype)
            tensors[name] = t
    return tensors, counts, nbytes


class WeightBlock:
    """One float32 allocation the model's matrices are carved from, in the order the forward reads them.

    Why one block and not an array per matrix: NumPy asks Linux for 2 MiB "huge" memory pages only
    for arrays of 4 MiB or more, and smaller matrices on 4 KiB pages cost address translations
    (TLB misses) on every decode step. Carved from one block, every matrix lies on huge pages,
    streamed one after another. The price is paid once, at load: the first write to each 2 MiB
    page is slower (the README's speed section has the measured figures).
    """

    def __init__(self, size: int):
        self.data = np.empty(size, dtype=np.float32)  # [size]; pages are committed as they are written
        self.used = 0

    def carve(self, rows: int, cols: int) -> np.ndarray:
        """The next ``[rows, cols]`` float32 view of the block (uninitialised: the caller fills it)."""
        start, self.used = self.used, self.used + rows * cols
        if self.used > self.data.size:
            raise ValueError(f"the weight block holds {self.data.size:,} values, carving past it")
        return self.data[start : self.used].reshape(rows, cols)


class TensorReader:
    """The tensors of one checkpoint, taken by key in minillm's layout.

    ``mmap``: every tensor is a read-only view of its file (one map per file), else a float32 copy.
    ``used`` collects the names taken; ``reading_s`` the seconds spent reading bytes, each tensor's
    as it is taken.
    """

    omits_tied_head = False  # a safetensors checkpoint with an untied config must carry its lm_head

    def __init__(
        self,
        folder: str | os.PathLike,
        config: ModelConfig,
        tensors: dict[str, StoredTensor],
        block: WeightBlock,
        mmap: bool,
    ):
        self.folder, self.config, self.tensors, self.block, self.mmap = folder, config, tensors, block, mmap
        self.names = NAME_MAPS[config.family]
        self.prefix = OPTIONAL_PREFIX.get(config.family)
        self.used: set[str] = set()
        self.maps: dict = {}  # mmap: one map per file
        self.reading_s = 0.0

    def find(self, key: str, i: int | None) -> str | None:
        """The file's name for ``key`` in layer ``i`` (with or without the family's optional prefix), or None."""
        name = self.names[key].format(i=i)
        if name in self.tensors:
            return name
        if self.prefix and name.startswith(self.prefix) and name[len(self.prefix) :] in self.tensors:
            return name[len(self.prefix) :]
        return None

    def take(self, key: str, shape: tuple[int, ...], i: int | None = None) -> np.ndarray:
        """Tensor ``key`` of layer ``i`` as float32 (or its mapped view), of ``shape``.

        Raises:
            WeightsError: the tensor is missing, of another shape, or stored in a dtype minillm does not read.
        """
        name = self.find(key, i)
        if name is None:
            raise WeightsError(
                f"tensor {self.names[key].format(i=i)!r} is missing from {Path(self.folder)}; the checkpoint is "
                f"incomplete or not a {self.config.model_type} model with this config.json. Re-download it."
            )
        stored = self.tensors[name]
        if stored.shape != shape:
            raise WeightsError(
                f"tensor {name!r} has shape {stored.shape}, expected {shape} from config.json; "
                "the weights and config.json belong to different models."
            )
        t = time.perf_counter()
        try:
            array = stored.mapped(self.maps) if self.mmap else stored.to_float32()
        except WeightsError as exc:
            raise WeightsError(f"tensor {name!r}: {exc}") from None
        self.reading_s += time.perf_counter() - t
        self.used.add(name)
        return array

    def maybe(self, cond: bool, key: str, shape: tuple[int, ...], i: int | None = None) -> np.ndarray | None:
        """:meth:`take` if ``cond`` (the config says the family has this tensor), else None."""
        return self.take(key, shape, i) if cond else None

    def linear(self, key: str, in_dim: int, out_dim: int, i: int) -> np.ndarray:
        """A projection as ``[out_dim, in_dim]``, whichever way the file stores it (a copy, or a view)."""
        if self.config.family in CONV1D_FAMILIES:  # Conv1D [in, out] -> [out, in] (a transposed view when mapped)
            return self.take(key, (in_dim, out_dim), i).T
        return self.take(key, (out_dim, in_dim), i)  # nn.Linear: already [out, in]

    def matrix(self, i: int, in_dim: int, *pieces: tuple[str, int]) -> Float32Matrix | StackedMatrix:
        """The projection stacking ``pieces`` ``(key, out_dim)`` row-wise: carved from the block and
        filled (eager), or the file's own matrices stacked side by side (mapped)."""
        if self.mmap:
            views = [Float32Matrix(self.linear(key, in_dim, out_dim, i)) for key, out_dim in pieces]
            return views[0] if len(views) == 1 else StackedMatrix(views)
        out = self.block.carve(sum(n for _, n in pieces), in_dim)
        row = 0
        for key, out_dim in pieces:
            out[row : row + out_dim] = self.linear(key, in_dim, out_dim, i)
            row += out_dim
        return Float32Matrix(out)

    def table(self, key: str, rows: int, cols: int) -> Float32Matrix:
        """A ``[rows, cols]`` table (the embedding, an untied LM head): carved and filled, or a view of the file."""
        if self.mmap:
            return Float32Matrix(self.take(key, (rows, cols)))
        out = self.block.carve(rows, cols)
        out[...] = self.take(key, (rows, cols))
        return Float32Matrix(out)

    def norm(self, key: str, dim: int, i: int | None = None) -> np.ndarray:
        """A norm's weight ``[dim]``, Gemma's ``1 +`` folded in."""
        w = self.take(key, (dim,), i)
        if self.config.norm_weight_offset:  # Gemma3RMSNorm: x_normed * (1 + w), in float32
            w = w + np.float32(self.config.norm_weight_offset)
        return w
