"""A distribution's most likely ids, for the trace's candidates and OpenAI's logprobs."""

from __future__ import annotations

import numpy as np


def top_candidates(probs: np.ndarray, k: int = 5) -> list[tuple[int, float]]:
    """The ``k`` most likely ids of a distribution ``[vocab]`` with probability > 0, most likely first
    (ties: the lower id first).

    Called for every row of every step when a trace listens: a full sort of 49,152 probabilities
    per row is a visible share of a batched step (README's batching section), so one partition
    finds the ``k``-th largest first and only the ids at or above it
    (ties at the threshold included, so the order among them is still the lower id first) are sorted.
    """
    kept = np.flatnonzero(probs > 0)
    if len(kept) > k:
        threshold = np.partition(probs[kept], len(kept) - k)[len(kept) - k]  # the k-th largest probability
        kept = kept[probs[kept] >= threshold]  # ascending ids: the stable sort below breaks ties by id
    top = kept[np.argsort(-probs[kept], kind="stable")[:k]]
    return [(int(i), float(probs[i])) for i in top]


def token_logprobs(probs: np.ndarray, token: int, n: int) -> dict:
    """OpenAI's logprobs of one step from the distribution sampled from (``float32 [vocab]``):
    ``{"id", "logprob", "top": [(id, logprob), ...]}`` with the ``n`` most likely alternatives
    (natural log; an id at probability 0 gets -inf)."""
    with np.errstate(divide="ignore"):
        return {
            "id": int(token),
            "logprob": float(np.log(np.float64(probs[token]))),
            "top": [(i, float(np.log(np.float64(q)))) for i, q in top_candidates(probs, n)] if n else [],
        }
