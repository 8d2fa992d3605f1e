"""``TunedKernels``: the textbook's three operations (``model/kernels.py``) in their fastest forms.

    linear            2 to ``FEW_ROWS`` rows of a batch: ``products.few_rows_product``, the plan
                      per BLAS kernel and thread count (``products.PLAN``); a prefill's projection
                      named in ``products.PREFILL_LEFT`` for this kernel: ``products.left``; else
                      the plain product
    attention         more than ``ATTENTION_CHUNK`` query rows: ``attention_in_chunks``
    batch_attention   a batch's decode rows over one paged pool together (``paged_decode.py``)

Every form gives the same sums in another order: float32 rounding apart, the plain kernels'
numbers (``tests/model/test_kernels.py`` and ``test_kernels_gemma3.py`` hold the logits within the
parity tests' tolerances of each other). Which form wins where
is measured by ``python -m benchmarks.batching`` and ``python -m benchmarks.speed``.
"""

from __future__ import annotations

import numpy as np

from minillm.kernels import products
from minillm.kernels.attention import ATTENTION_CHUNK, attention_in_chunks
from minillm.kernels.paged_decode import GroupedAttention
from minillm.model.batch import Attend
from minillm.model.held import HeldMatrix
from minillm.model.kernels import Kernels


class TunedKernels(Kernels):
    """The engine room's kernels: the plain ones' results, by faster formulations on this machine."""

    name = "tuned"
    source = "minillm/kernels"

    def linear(
        self, x: np.ndarray, w: HeldMatrix, b: np.ndarray | None = None, *, projection: str | None = None, batched=False
    ) -> np.ndarray:
        """``x @ w.T (+ b)`` as :class:`Kernels.linear`, a float32 matrix's product in the formulation
        the plan names: few-rows for 2 to ``FEW_ROWS`` rows when ``batched``, ``left`` for a prefill
        of a projection ``PREFILL_LEFT`` lists (its column-major result kept: no copy)."""
        parts = w.parts()
        if any(part.dense is None for part in parts):  # a compact format: its own chunked product
            y = w.linear(x)
        elif len(parts) > 1:  # memory-mapped parts: each a float32 array, each its own product
            y = np.concatenate([self._product(x, part.dense, batched) for part in parts], axis=-1)
        elif projection is not None and products.prefill_formulation(projection, x.shape[0]) == "left":
            y = products.left(x, w.dense)  # [rows, out], column-major
            return y if b is None else y + b
        else:
            y = self._product(x, w.dense, batched)
        if b is not None:
            y += b
        return y

    @staticmethod
    def _product(x: np.ndarray, w: np.ndarray, batched: bool) -> np.ndarray:
        """A float32 ``[rows, in] @ [in, out]``: the few-rows plan inside a batched pass, else ``x @ w.T``."""
        if batched and 1 < x.shape[0] <= products.FEW_ROWS:
            return products.few_rows_product(x, w)  # [rows, out]
        return x @ w.T

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
        """:class:`Kernels.attention`, in causal chunks above ``ATTENTION_CHUNK`` query rows."""
        if q.shape[-2] > ATTENTION_CHUNK:  # long prefill: causal chunks, scores in cache
            return attention_in_chunks(q, k, v, mask, scale)
        return super().attention(q, k, v, mask, scale)

    def batch_attention(self, model, sequences: list[Attend], caches: list, bounds: np.ndarray) -> Attend:
        """:class:`Kernels.batch_attention` with one paged pool's decode rows attended together."""
        return GroupedAttention(model, sequences, caches, bounds)


#: The tuned kernels, shared (they hold no state).
TUNED = TunedKernels()
