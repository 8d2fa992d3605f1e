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

and the textbook's units the forward is made of are looked up on the kernels too, each the
``primitives`` function of the same name unless replaced: ``causal_mask``, ``sliding_window_mask``,
``softmax``, ``rms_norm``, ``apply_rope``, ``silu`` and the ``KVCache`` a request's cache is built as
(:meth:`Kernels.new_cache`). That is where a student's unit plugs in (:class:`UnitKernels`, built by
``minillm/runtime/units.py`` from a folder of the exercises): one mechanism, no module patched.

The engine room (``minillm/kernels/``, ``TunedKernels``) overrides them, and its pass, with faster
formulations of the same sums: few-rows products for a batch, the transposed product for a prefill
of the matrices it chose at load, attention in causal chunks, a batch's decode rows attended
together over the paged pool. The textbook never imports the engine room;
``minillm.load(name, kernels=...)`` chooses which object the model holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from minillm.model import primitives
from minillm.model.config import ModelConfig
from minillm.model.held import HeldMatrix
from minillm.model.kv_cache import KVCache
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
        ``[seq, ctx]`` additive), normalized by :attr:`softmax`."""
        z, _ = primitives.attention(q, k, v, mask, scale, softmax=self.softmax)
        return z

    # --- the textbook's units, each replaceable (UnitKernels) ------------------------------------------
    causal_mask = staticmethod(primitives.causal_mask)
    sliding_window_mask = staticmethod(primitives.sliding_window_mask)
    softmax = staticmethod(primitives.softmax)
    rms_norm = staticmethod(primitives.rms_norm)
    apply_rope = staticmethod(primitives.apply_rope)
    silu = staticmethod(primitives.silu)
    #: The class a request's contiguous KV cache is built as (:meth:`new_cache`).
    KVCache = KVCache

    def activation(self, hidden_act: str) -> Callable[[np.ndarray], np.ndarray]:
        """The MLP's activation for ``ModelConfig.hidden_act``: :attr:`silu` for ``"silu"``, else
        ``primitives.ACTIVATIONS``."""
        return self.silu if hidden_act == "silu" else primitives.ACTIVATIONS[hidden_act]

    def qk_norm_rope(self, q, k, q_norm, k_norm, eps: float, rope) -> tuple[np.ndarray, np.ndarray]:
        """``primitives.qk_norm_rope`` with these kernels' :attr:`rms_norm` and :attr:`apply_rope`
        (shapes there: ``[heads, seq, head_dim]`` in and out)."""
        return primitives.qk_norm_rope(
            q, k, q_norm, k_norm, eps, rope, rms_norm=self.rms_norm, apply_rope=self.apply_rope
        )

    def new_cache(self, config: ModelConfig, max_seq_len: int | None = None, dtype: str = "float32") -> KVCache:
        """A request's contiguous cache for ``config`` (``KVCache.for_model``, same errors), built as
        :attr:`KVCache`."""
        return self.KVCache.for_model(config, max_seq_len, dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}: {self.source})"


#: The plain kernels, shared (they hold no state).
PLAIN = Kernels()

#: The units :class:`UnitKernels` can take from a student, in the order the forward meets them.
MODEL_UNITS = (
    "causal_mask",
    "sliding_window_mask",
    "softmax",
    "rms_norm",
    "apply_rope",
    "attention",
    "silu",
    "KVCache",
)


class UnitKernels(Kernels):
    """The plain kernels with some of the textbook's units replaced: a student's (the exercises).

    Args:
        units: unit name (one of :data:`MODEL_UNITS`) -> the replacement, already wrapped by the
            caller so that it is handed read-only arrays (``minillm/runtime/units.py``); an
            ``attention`` returns ``(z, pattern)`` as ``primitives.attention`` does; a ``KVCache`` is a
            subclass of :class:`~minillm.model.kv_cache.KVCache`.
        source: where the units came from (a folder), for the trace's load section.

    Raises:
        ValueError: a name that is not a unit the forward takes.
    """

    def __init__(self, units: Mapping[str, Callable], source: str):
        unknown = sorted(set(units) - set(MODEL_UNITS))
        if unknown:
            raise ValueError(f"not units of the forward: {', '.join(unknown)}; the units are {', '.join(MODEL_UNITS)}.")
        self.units = dict(units)
        self.source = source
        self.name = "plain + the student's " + ", ".join(u for u in MODEL_UNITS if u in units) if units else "plain"
        for name, unit in units.items():
            if name == "attention":
                self.student_attention = unit
            elif name == "KVCache":
                self.KVCache = unit
            else:
                setattr(self, name, unit)  # shadows the textbook's (a class attribute)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
        """The student's attention if there is one (its ``z``), else the textbook's with this softmax."""
        if "attention" not in self.units:
            return super().attention(q, k, v, mask, scale)
        z, _ = self.student_attention(q, k, v, mask, scale)
        return z
