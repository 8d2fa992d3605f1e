"""Logits as the sampler takes them: ``float32 [vocab]``, checked, and kept inside float32's range.

No valid sampling setting may give NaN or infinite probabilities, nor overflow on the way. Dividing
by a tiny temperature (or a tiny repetition penalty) can leave float32's range in two ways: a
scaled logit itself (``3 / 1e-40 = 3e40``), or the distance between two that are each inside it
(``0.01 / 1e-40 = 1e38`` and ``-0.03 / 1e-40 = -3e38`` are 4e38 apart, and softmax's first step,
subtracting the largest, overflows). Softmax does not change when every logit moves by the same
amount, so :func:`limit_or_float32` then measures each logit from the largest (in float64): the
largest is 0, and one further below it than float32's range is ``-inf``, whose probability is the
0 that ``exp`` of it rounds to anyway. When the largest itself is beyond the range, every other
distinct value is at least float64's spacing there (2^75) below it, far more than the ~104 it
takes for ``exp`` to reach 0: such a step is greedy, and is computed as greedy (the rest at probability 0).
A NaN logit is an error (the forward pass broke); ``-inf`` logits are masked ids and stay at
probability 0. Underflow (``exp(-200)`` -> 0) is the right float32 answer.
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
    """float64 scaled logits ``[vocab]`` -> float32 ``[vocab]`` of the same distribution, which
    softmax can take without overflow.

    Inside float32's range (each value, and the largest minus the smallest finite one): the values
    rounded to float32, as transformers' float32 arithmetic gives them. Otherwise measured from the
    largest (see the module note): the largest (and exact ties) at 0, the rest ``value - largest``,
    and ``-inf`` where that is beyond float32's range. A ``+inf`` takes all the probability: the
    ``+inf`` ids at 0, the rest at ``-inf``.
    Example: ``[1e38, -3e38]`` (4e38 apart) -> ``[0, -inf]``; ``[3e40, 1e40]`` -> ``[0, -inf]``.
    """
    top = float(np.max(values))
    if top == np.inf:
        out = np.full(values.shape, -np.inf, dtype=np.float32)
        out[values == top] = 0.0
        return out
    finite = values[values > -np.inf]
    if top <= F32_MAX and float(finite.min()) >= -F32_MAX:
        with np.errstate(under="ignore"):  # a tiny scaled logit rounds to 0 or a subnormal: fine
            out = values.astype(np.float32)
        if spread(out) <= F32_MAX:  # softmax's subtraction of the largest stays in range
            return out
    shifted = values - top  # float64: exact enough, never overflows (as_float32_value bounds the scale)
    shifted[shifted < -F32_MAX] = -np.inf
    with np.errstate(under="ignore"):
        return shifted.astype(np.float32)


def spread(logits: np.ndarray) -> float:
    """The largest finite-or-``+inf`` logit minus the smallest finite one, in float64 (0 for one id or none):
    what softmax's first step (subtract the largest) must hold in float32's range."""
    finite = logits[logits > -np.inf]
    return float(finite.max()) - float(finite.min()) if finite.size else 0.0


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

    A +inf logit takes all the probability (shared by ties). Logits further apart than float32's
    range are measured from the largest first (:func:`limit_or_float32`). Underflow is allowed:
    ``exp`` of a very negative number is 0, the right float32 answer.

    Raises:
        InvalidRequestError: a NaN, or every id masked.
    """
    x = as_logits(logits)
    if x.max() == np.inf:
        return (x == np.inf).astype(np.float32) / np.float32(np.count_nonzero(x == np.inf))
    if spread(x) > F32_MAX:  # e.g. raw logits 3e38 and -3e38: measured from the largest first (module note)
        x = limit_or_float32(x.astype(np.float64))
    with np.errstate(under="ignore"):
        return softmax(x)
