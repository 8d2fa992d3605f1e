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
from minillm.model.kernels import Kernels


class TunedKernels(Kernels):
    """The engine room's kernels: the plain ones' results, by faster formulations on this machine."""

    name = "tuned"
    source = "minillm/kernels"

    def linear(
        self, x: np.ndarray, w, b: np.ndarray | None = None, *, projection: str | None = None, batched: bool = False
    ) -> np.ndarray:
        """``x @ w.T (+ b)`` as :class:`Kernels.linear`, a float32 array's product in the formulation
        the plan names: few-rows for 2 to ``FEW_ROWS`` rows when ``batched``, ``left`` for a prefill
        of a projection ``PREFILL_LEFT`` lists (its column-major result kept: no copy)."""
        if isinstance(w, tuple):  # memory-mapped parts: each a float32 array, each its own product
            y = np.concatenate([self.linear(x, part, batched=batched) for part in w], axis=-1)
        elif not isinstance(w, np.ndarray):  # a held matrix: its own chunked product
            y = w.linear(x)
        elif batched and 1 < x.shape[0] <= products.FEW_ROWS:
            y = products.few_rows_product(x, w)  # [rows, out]
        elif projection is not None and products.prefill_formulation(projection, x.shape[0]) == "left":
            y = products.left(x, w)  # [rows, out], column-major
            return y if b is None else y + b
        else:
            y = x @ w.T
        if b is not None:
            y += b
        return y

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
