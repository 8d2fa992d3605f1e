"""The seam between the textbook and the engine room: the few operations that have tuned forms.

``Transformer`` (``transformer.py``) holds a :class:`Kernels` object and calls it for exactly three
things; everything else in a forward pass is written out on the page:

    kernels.linear(x, w, b)              a projection: x @ w.T (+ b)
    kernels.attention(q, k, v, mask, s)  one sequence's attention: softmax(q k.T * s + mask) v
    kernels.batch_attention(...)         a batch's attention: every sequence over its own keys

This class is the plain form, the one the lessons read: each is one NumPy expression or the
one-sequence path called per sequence. The engine room (``minillm/kernels/``, ``TunedKernels``)
overrides the same methods with faster formulations of the same sums: few-rows products, the
transposed product, attention in causal chunks, a batch's decode rows attended together over the
paged pool. The textbook never imports the engine room; ``minillm.load(name, kernels=...)``
chooses which object the model holds.
"""

from __future__ import annotations

import numpy as np

from minillm.model import primitives
from minillm.model.batch import Attend, BatchAttention
from minillm.model.held import HeldMatrix


class Kernels:
    """The plain kernels: what each operation means, in its most direct NumPy form."""

    #: How ``minillm.load``'s ``kernels=`` names this implementation (and the trace shows it).
    name = "plain"
    #: Where its code lives (the trace's load section shows it).
    source = "minillm/model"

    def linear(
        self, x: np.ndarray, w: HeldMatrix, b: np.ndarray | None = None, *, projection: str | None = None, batched=False
    ) -> np.ndarray:
        """``x @ w.T (+ b)``: ``x`` float32 ``[rows, in]``, ``w`` ``[out, in]`` -> ``[rows, out]`` float32.

        ``w`` is a held matrix (``held.py``): float32 (``x @ w.T`` on the page), a compact format (its
        own chunked product), or a memory-mapped projection's parts (one product each, side by side). ``projection``
        (``"qkv"``, ``"o"``, ``"gate_up"``, ``"up"``, ``"down"``, ``"lm_head"``) and ``batched``
        (the rows are several sequences') tell a tuned form which product this is; the plain one
        ignores them.
        """
        y = w.linear(x)  # [rows, in] @ [in, out] -> [rows, out], however w is held
        if b is not None:
            y += b  # in place: the product is a fresh array
        return y

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
        """One sequence's attention ``z`` ``[n_heads, seq, head_dim]``: ``primitives.attention``
        (``q`` ``[n_heads, seq, head_dim]``, ``k``/``v`` ``[n_kv_heads, ctx, head_dim]``, ``mask``
        ``[seq, ctx]`` additive)."""
        z, _ = primitives.attention(q, k, v, mask, scale)
        return z

    def batch_attention(self, model, sequences: list[Attend], caches: list, bounds: np.ndarray) -> Attend:
        """Attention for a batch: sequence ``j`` owns rows ``bounds[j]:bounds[j+1]`` and is attended
        by ``sequences[j]`` (a ``transformer.SequenceAttention`` over ``caches[j]``), exactly as
        ``Transformer.forward`` attends it alone. ``model`` (the ``Transformer``) is for tuned forms."""
        return BatchAttention(model.config.q_dim, sequences, bounds)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}: {self.source})"


#: The plain kernels, shared (they hold no state).
PLAIN = Kernels()
