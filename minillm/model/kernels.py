"""The seam between the textbook and the engine room, crossed at two moments.

    kernels.prepare(weights)                  once, at load: the kernels this model's matrices use
                                              (the plain ones choose nothing; the tuned ones decide
                                              per matrix, gpt-fast's swap at load)
    kernels.begin(config, tables, chunks)     once per forward pass: a pass (``passes.py``) that knows
                                              its rows, caches and capture, and offers
                                              ``linear(x, w, b)`` and ``attend(i, qkv, ...)``

Per call, nothing crosses but arrays and held matrices: the layers of ``transformer.py`` ask the
pass for ``x @ w.T`` and for a layer's attention. The two operations a pass is built on are the
kernels' own, here in their most direct NumPy form (the lessons read these):

    kernels.linear(x, w, b)              a projection: x @ w.T (+ b)
    kernels.attention(q, k, v, mask, s)  one sequence's attention: softmax(q k.T * s + mask) v

The engine room (``minillm/kernels/``, ``TunedKernels``) overrides them, and its pass, with faster
formulations of the same sums: few-rows products for a batch, the transposed product for a prefill
of the matrices it chose at load, attention in causal chunks, a batch's decode rows attended
together over the paged pool. The textbook never imports the engine room;
``minillm.load(name, kernels=...)`` chooses which object the model holds.
"""

from __future__ import annotations

import numpy as np

from minillm.model import primitives
from minillm.model.config import ModelConfig
from minillm.model.held import HeldMatrix
from minillm.model.passes import ForwardPass
from minillm.model.positions import PositionTables


class Kernels:
    """The plain kernels: what each operation means, in its most direct NumPy form."""

    #: How ``minillm.load``'s ``kernels=`` names this implementation (and the trace shows it).
    name = "plain"
    #: Where its code lives (the trace's load section shows it).
    source = "minillm/model"

    def prepare(self, weights) -> Kernels:
        """The kernels a model holding ``weights`` (``weights.Weights``) uses, decided once at load.
        The plain kernels choose nothing: themselves."""
        return self

    def begin(self, config: ModelConfig, tables: PositionTables, chunks, *, batch=False, capture=None) -> ForwardPass:
        """A forward pass over ``chunks`` (``(positions [seq_j] int, cache or None)`` per sequence, rows
        in that order): :class:`~minillm.model.passes.ForwardPass`. ``batch``: the rows are a batch's
        (``Transformer.forward_batch``); ``capture``: a dict for intermediates, or None."""
        return ForwardPass(self, config, tables, chunks, batch=batch, capture=capture)

    def linear(self, x: np.ndarray, w: HeldMatrix, b: np.ndarray | None = None) -> np.ndarray:
        """``x @ w.T (+ b)``: ``x`` float32 ``[rows, in]``, ``w`` ``[out, in]`` -> ``[rows, out]`` float32.

        ``w`` is a held matrix (``held.py``): float32 (``x @ w.T`` on the page), a compact format (its
        own chunked product), or a memory-mapped projection's parts (one product each, side by side).
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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}: {self.source})"


#: The plain kernels, shared (they hold no state).
PLAIN = Kernels()
