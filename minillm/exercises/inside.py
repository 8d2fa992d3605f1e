"""The second grading: the unit at work, inside the real model or inside the method it serves.

- **Inside the model** (masks, softmax, RMSNorm, RoPE, attention, SiLU, the KV cache): the student's
  unit replaces the textbook's in SmolLM2 through the seam (``model/kernels.py``'s
  :class:`~minillm.model.kernels.UnitKernels`, the same mechanism as ``minillm run --units``); a fixed
  greedy request (:data:`PROMPT`, :data:`NEW_TOKENS` new tokens) must give the textbook's ids, with
  every step's logits within :data:`PARITY_ATOL` of the textbook's (the tolerance the project holds
  its logits to against transformers).
- **Closed form** (the sampling processors, speculative decoding's acceptance rule): on a vocabulary
  of a few ids, the distribution the student's unit leaves equals the one its formula gives, worked
  out here from the definition (not by calling the textbook).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minillm.exercises.compare import Failed, expect_array
from minillm.model.kernels import PLAIN, UnitKernels
from minillm.model.transformer import Transformer
from minillm.runtime import speculative as SP
from minillm.runtime.units import read_only, student_cache_class

PROMPT = "The capital of France is"
NEW_TOKENS = 6
#: Logits of the student's model against the textbook's: the parity tolerance (README: "within 1e-4").
PARITY_ATOL = 1e-4


def greedy(
    transformer: Transformer, prompt_ids: np.ndarray, new_tokens: int = NEW_TOKENS
) -> tuple[list[int], np.ndarray]:
    """Greedy decoding on ``transformer``: prefill, then one decode step per new token, on a cache its
    kernels build (``Kernels.new_cache``). Returns the new ids and every step's logits
    ``[new_tokens, vocab]`` float32."""
    cache = transformer.kernels.new_cache(transformer.config, len(prompt_ids) + new_tokens)
    logits = transformer.forward(np.asarray(prompt_ids), cache, last_only=True)[-1]
    ids, steps = [], []
    for _ in range(new_tokens):
        steps.append(np.array(logits, dtype=np.float32))
        ids.append(int(np.argmax(logits)))
        logits = transformer.forward(np.array([ids[-1]]), cache, last_only=True)[-1]
    return ids, np.stack(steps)


class ModelReference:
    """SmolLM2's greedy answer to :data:`PROMPT` on the textbook's plain kernels: what a student's model
    must reproduce. ``model``: a loaded ``minillm`` model (its weights; whichever kernels it holds)."""

    def __init__(self, model):
        self.model = model
        self.prompt_ids = model.tokenizer.encode(PROMPT)
        textbook = Transformer(model.config, model.transformer.weights, PLAIN)
        self.ids, self.logits = greedy(textbook, self.prompt_ids)

    def check(self, unit: str, impl, source: str) -> None:
        """Run the request with ``impl`` as ``unit``; raise :class:`Failed` unless the ids are the
        textbook's and the logits within :data:`PARITY_ATOL`."""
        wrapped = student_cache_class(impl) if unit == "KVCache" else read_only(impl)
        kernels = UnitKernels({unit: wrapped}, source=source)
        transformer = Transformer(self.model.config, self.model.transformer.weights, kernels)
        where = f"SmolLM2 greedy on {PROMPT!r}, {NEW_TOKENS} new tokens, with your {unit}"
        with np.errstate(all="ignore"):
            ids, logits = greedy(transformer, self.prompt_ids)
        tok = self.model.tokenizer
        if ids != self.ids:
            n = next(i for i, (a, b) in enumerate(zip(ids, self.ids, strict=True)) if a != b)
            raise Failed(
                where,
                f"the ids differ first at new token {n}: {ids[n]} ({tok.decode([ids[n]])!r}) where the textbook's "
                f"model gives {self.ids[n]} ({tok.decode([self.ids[n]])!r}); yours wrote {tok.decode(ids)!r}, the "
                f"textbook's {tok.decode(self.ids)!r}",
            )
        expect_array(where, logits, self.logits, atol=PARITY_ATOL, rtol=0, what="the logits of each step")


# --- closed forms on a small vocabulary -------------------------------------------------------------
LOGITS = np.array([2.0, 1.5, 0.3, -0.4, -1.0, -2.5], dtype=np.float32)


def _softmax64(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def _renormalized(p: np.ndarray, keep: np.ndarray) -> np.ndarray:
    kept = np.where(keep, p, 0.0)
    return kept / kept.sum()


def _distribution_of(fn: Callable, *args) -> np.ndarray:
    out = fn(LOGITS.copy(), *args)
    return _softmax64(out)


def closed_form(unit: str, ns) -> None:
    """The distribution ``unit`` (from the student's namespace ``ns``) leaves, against its formula;
    raise :class:`Failed` on a difference."""
    p = _softmax64(LOGITS)
    order = np.argsort(-p, kind="stable")
    if unit == "apply_temperature":
        cases = [((t,), _softmax64(LOGITS.astype(np.float64) / t)) for t in (0.5, 2.0)]
    elif unit == "apply_top_k":
        cases = [((k,), _renormalized(p, np.isin(np.arange(len(p)), order[:k]))) for k in (1, 3)]
    elif unit == "apply_top_p":
        cases = []
        for top_p in (0.5, 0.9):
            n = int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)  # the smallest prefix reaching top_p
            cases.append(((top_p,), _renormalized(p, np.isin(np.arange(len(p)), order[:n]))))
    elif unit == "apply_min_p":
        cases = [((m,), _renormalized(p, p >= m * p.max())) for m in (0.1, 0.5)]
    elif unit == "apply_repetition_penalty":
        seen, penalty = [0, 3, 3], 2.0
        x = LOGITS.astype(np.float64).copy()
        for i in set(seen):
            x[i] = x[i] / penalty if x[i] > 0 else x[i] * penalty
        cases = [((seen, penalty), _softmax64(x))]
    elif unit in ("acceptance_probability", "residual"):
        _speculative_identity(unit, ns)
        return
    else:
        raise KeyError(unit)
    for args, want in cases:
        where = f"the distribution {unit}{args} leaves on a vocabulary of {len(LOGITS)} (logits {LOGITS.tolist()})"
        with np.errstate(all="ignore"):
            got = _distribution_of(getattr(ns, unit), *args)
        expect_array(where, got, want, atol=1e-6, rtol=1e-5, what="the probabilities")


def _speculative_identity(unit: str, ns) -> None:
    """Leviathan et al. 2023, Theorem 1: drafting from ``q``, keeping ``x`` with ``a(x)``, else drawing
    from the residual, samples exactly ``p``: ``q(y) a(y) + (sum_x q(x) (1 - a(x))) residual(y) = p(y)``."""
    accept = ns.acceptance_probability if unit == "acceptance_probability" else SP.acceptance_probability
    resid = ns.residual if unit == "residual" else SP.residual
    g = np.random.default_rng(7)
    for trial in range(3):
        p, q = g.random(6) ** 2, g.random(6) ** 2
        p, q = p / p.sum(), q / q.sum()
        a = np.array([accept(p, q, x) for x in range(6)], dtype=np.float64)
        rejected = float(np.sum(q * (1 - a)))
        # the residual does not depend on the drafted x when q is a distribution
        sampled = q * a + rejected * np.asarray(resid(p, q, 0), dtype=np.float64)
        where = f"speculative sampling with your {unit}: drafts from q, trial {trial + 1} (vocabulary of 6)"
        expect_array(where, sampled, p, atol=1e-9, rtol=1e-7, what="the distribution sampled (must be p)")
