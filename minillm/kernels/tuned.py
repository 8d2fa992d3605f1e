"""``TunedKernels``: the textbook's seam (``model/kernels.py``) in its fastest forms.

    prepare           at load: the matrices whose prefill product takes ``products.left`` on this
                      BLAS kernel (``products.PREFILL_LEFT``), chosen once per matrix
    linear            one sequence's rows: the plain product, or ``left`` for a prefill of a matrix
                      chosen at load
    attention         more than ``ATTENTION_CHUNK`` query rows: ``attention_in_chunks``
    begin             a :class:`TunedPass`: a batch's 2 to ``FEW_ROWS`` rows through
                      ``products.few_rows_product`` (the plan per BLAS kernel and thread count,
                      ``products.PLAN``), and a batch's decode rows over one paged pool attended
                      together (``paged_decode.py``)

Every form gives the same sums in another order: float32 rounding apart, the plain kernels'
numbers (``tests/model/test_kernels.py`` and ``test_kernels_gemma3.py`` hold the logits within the
parity tests' tolerances of each other). Which form wins where
is measured by ``python -m benchmarks.batching`` and ``python -m benchmarks.speed``.
"""

from __future__ import annotations

import numpy as np

from minillm.kernels import products
from minillm.kernels.attention import ATTENTION_CHUNK, attention_in_chunks
from minillm.kernels.paged_decode import DecodeRows
from minillm.model.held import HeldMatrix
from minillm.model.kernels import Kernels
from minillm.model.paged_sequence import PagedSequence
from minillm.model.passes import ForwardPass


class TunedKernels(Kernels):
    """The engine room's kernels: the plain ones' results, by faster formulations on this machine.

    ``left_in_prefill``: the matrices (by identity) whose prefill product is ``products.left``,
    chosen by :meth:`prepare`; the shared :data:`TUNED` holds none.
    """

    name = "tuned"
    source = "minillm/kernels"

    def __init__(self, left_in_prefill: dict[int, HeldMatrix] | None = None):
        self.left_in_prefill = left_in_prefill or {}  # id -> the matrix (held: its id stays its own)

    def prepare(self, weights) -> TunedKernels:
        """The tuned kernels for ``weights`` (``weights.Weights``): every layer's matrix of a projection
        :data:`products.PREFILL_LEFT` lists for this BLAS kernel takes ``left`` in a prefill."""
        listed = products.PREFILL_LEFT.get(products.blas_kernel(), ())
        chosen = [getattr(layer, "w_" + name, None) for layer in weights.layers for name in sorted(listed)]
        return TunedKernels({id(w): w for w in chosen if w is not None})

    def begin(self, config, tables, chunks, *, batch: bool = False, capture: dict | None = None) -> TunedPass:
        """:class:`Kernels.begin`, the engine room's pass (:class:`TunedPass`)."""
        return TunedPass(self, config, tables, chunks, batch=batch, capture=capture)

    def linear(self, x: np.ndarray, w: HeldMatrix, b: np.ndarray | None = None) -> np.ndarray:
        """``x @ w.T (+ b)`` as :class:`Kernels.linear` for one sequence's rows: ``left`` for a prefill
        (more than ``FEW_ROWS`` rows) of a matrix :meth:`prepare` chose (its column-major result
        kept: no copy), else the plain product."""
        if x.shape[0] > products.FEW_ROWS and id(w) in self.left_in_prefill and len(w.parts()) == 1:
            dense = w.parts()[0].dense
            if dense is not None:
                y = products.left(x, dense)  # [rows, out], column-major
                return y if b is None else y + b
        return product(x, w, b, few_rows=False)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
        """:class:`Kernels.attention`, in causal chunks above ``ATTENTION_CHUNK`` query rows."""
        if q.shape[-2] > ATTENTION_CHUNK:  # long prefill: causal chunks, scores in cache
            return attention_in_chunks(q, k, v, mask, scale)
        return super().attention(q, k, v, mask, scale)


def product(x: np.ndarray, w: HeldMatrix, b: np.ndarray | None, *, few_rows: bool) -> np.ndarray:
    """``x @ w.T (+ b)``, ``x`` float32 ``[rows, in]`` -> ``[rows, out]``: a compact format's own
    chunked product; a float32 matrix (or each memory-mapped part) by ``products.few_rows_product``
    when ``few_rows`` and 2 to ``FEW_ROWS`` rows, else ``x @ w.T``."""
    parts = w.parts()
    if len(parts) == 1:  # the common case first: one matrix, float32 or a compact format
        dense = parts[0].dense
        y = w.linear(x) if dense is None else _dense_product(x, dense, few_rows)
    elif any(part.dense is None for part in parts):  # a compact format: its own chunked product
        y = w.linear(x)
    else:  # memory-mapped parts: each a float32 array, each its own product
        y = np.concatenate([_dense_product(x, part.dense, few_rows) for part in parts], axis=-1)
    if b is not None:
        y += b
    return y


def _dense_product(x: np.ndarray, w: np.ndarray, few_rows: bool) -> np.ndarray:
    """A float32 ``[rows, in] @ [in, out]``: the few-rows plan when asked and 2..FEW_ROWS rows, else ``x @ w.T``."""
    if few_rows and 1 < x.shape[0] <= products.FEW_ROWS:
        return products.few_rows_product(x, w)  # [rows, out]
    return x @ w.T


class TunedPass(ForwardPass):
    """The textbook's pass (``passes.ForwardPass``) with a batch's products in their few-rows forms
    and the batch's decode rows (one row, a :class:`PagedSequence` of the first such row's pool)
    attended together (:class:`DecodeRows`); prefill chunks and contiguous caches one sequence at a time."""

    def __init__(self, kernels: TunedKernels, config, tables, chunks, *, batch: bool = False, capture=None):
        super().__init__(kernels, config, tables, chunks, batch=batch, capture=capture)
        self.decode = None
        one_row = [j for j in self.alone if self.bounds[j + 1] - self.bounds[j] == 1]
        first = self.caches[one_row[0]] if batch and one_row else None
        if isinstance(first, PagedSequence):  # the decode rows of its pool, together
            grouped = [
                j for j in one_row if isinstance(self.caches[j], PagedSequence) and self.caches[j].pool is first.pool
            ]
            self.alone = [j for j in self.alone if j not in set(grouped)]
            self.decode = DecodeRows(config, tables, [self.caches[j] for j in grouped], self.bounds[grouped])

    def linear(self, x: np.ndarray, w: HeldMatrix, b: np.ndarray | None = None) -> np.ndarray:
        """:meth:`TunedKernels.linear`, with the few-rows plan for a batch's 2 to ``FEW_ROWS`` rows."""
        if self.batch and x.shape[0] <= products.FEW_ROWS:
            return product(x, w, b, few_rows=True)
        return self.kernels.linear(x, w, b)

    def attend(self, i: int, qkv: np.ndarray, q_norm=None, k_norm=None) -> np.ndarray:
        """:meth:`ForwardPass.attend`, the grouped decode rows in one set of calls."""
        if self.decode is None:
            return super().attend(i, qkv, q_norm, k_norm)
        z = np.empty((qkv.shape[0], self.config.q_dim), dtype=np.float32)  # [rows, q_dim]
        z[self.decode.rows] = self.decode(i, qkv[self.decode.rows], q_norm, k_norm)
        self.attend_alone(i, qkv, q_norm, k_norm, z)  # prefill chunks, contiguous caches
        return z


#: The tuned kernels, shared (they hold no state until :meth:`TunedKernels.prepare` gives a model its own).
TUNED = TunedKernels()
