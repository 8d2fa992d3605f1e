"""Logits as the sampler takes them: ``float32 [vocab]``, checked, and kept inside float32's range.

No valid sampling setting may give NaN or infinite probabilities. Dividing by a tiny temperature
(or a tiny repetition penalty) can overflow float32 (``3 / 1e-40``); two distinct float32 logits
scaled that far apart differ by far more than the ~104 it takes for ``exp`` to reach 0, so the
distribution is one-hot on the largest: such a step *is* greedy, and :func:`limit_or_float32`
computes it as greedy. A NaN logit is an error (the forward pass broke); ``-inf`` logits are
masked ids and stay at probability 0. Underflow (``exp(-200)`` -> 0) is the right float32 answer.
"""

from __future__ import annotations

import numpy as np

from minillm.errors import InvalidRequestError
from minillm.model.primitives import softmax

F32_MAX = float(np.finfo(np.float32).max)  # about 3.4e38


def as_logits(logits) -> np.ndarray:
    """A float32 ``[vocab]`` copy (processors never modify their input).

    Raises:
        InvalidRequestError: wrong shape, a NaN, or every id masked (all ``-inf``).
    """
    with np.errstate(over="ignore", under="ignore"):  # float64 input beyond float32: inf / 0, checked next
        out = np.array(logits, dtype=np.float32)  # copy
    if out.ndim != 1 or out.size == 0:
        raise InvalidRequestError(f"logits must have shape [vocab], got {out.shape}; pass the last position's row")
    if np.isnan(out).any():
        bad = np.flatnonzero(np.isnan(out))
        raise InvalidRequestError(
            f"logits contain NaN at {bad.size} of {out.size} ids (first: id {bad[0]}); the forward pass produced "
            "NaN (overflow in the weights or activations): check the weights and the dtype they were loaded in"
        )
    if np.isneginf(out).all():
        raise InvalidRequestError(
            "every logit is -inf: all ids are masked and there is nothing to sample; leave at least one id unmasked"
        )
    return out


def limit_or_float32(values: np.ndarray) -> np.ndarray:
    """float64 scaled logits -> float32, or, where they left float32's range, the limit: greedy.

    Beyond float32's range (or at +inf) the largest logit takes all the probability (see the
    module note), so only it (and exact ties) is kept, at 0, the rest at -inf.
    """
    top = np.max(values)
    if top == np.inf or np.abs(values[np.isfinite(values)]).max(initial=0.0) > F32_MAX:
        out = np.full(values.shape, -np.inf, dtype=np.float32)
        out[values == top] = 0.0
        return out
    with np.errstate(under="ignore"):  # a tiny scaled logit rounds to 0 or a subnormal: fine
        return values.astype(np.float32)


def as_float32_value(value: float) -> float:
    """A positive parameter rounded to float32, as transformers holds it, as a Python float, kept
    inside float32's range: below it, the smallest float32 (1.4e-45); above it, the largest. Then a
    float32 logit scaled by it (at most 3.4e38 * 3.4e38, or / 1.4e-45) never overflows float64, so
    the order of the scaled logits survives for :func:`limit_or_float32`."""
    smallest = float(np.finfo(np.float32).smallest_subnormal)
    if value >= F32_MAX:
        return F32_MAX
    with np.errstate(under="ignore"):
        return max(float(np.float32(value)), smallest)


def probabilities(logits) -> np.ndarray:
    """The model's softmax (``primitives.softmax``, float32 as transformers computes it) made safe
    for sampling: ``float32 [vocab]``, finite, summing to 1, masked (-inf) ids at 0.

    A +inf logit takes all the probability (shared by ties). Underflow is allowed: ``exp`` of a
    very negative number is 0, the right float32 answer.

    Raises:
        InvalidRequestError: a NaN, or every id masked.
    """
    x = as_logits(logits)
    if x.max() == np.inf:
        return (x == np.inf).astype(np.float32) / np.float32(np.count_nonzero(x == np.inf))
    with np.errstate(under="ignore"):
        return softmax(x)
