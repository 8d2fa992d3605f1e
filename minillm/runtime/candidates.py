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


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log softmax(logits)`` of one row ``[vocab]``, in float64, measured from the largest logit."""
    z = np.asarray(logits, dtype=np.float64)
    shifted = z - z.max()
    return shifted - np.log(np.exp(shifted).sum())  # [vocab]


def model_logprobs(logits: np.ndarray, token: int, n: int, sampled: np.ndarray | None = None) -> dict:
    """OpenAI's logprobs of one step: the model's own log-probabilities, ``log_softmax`` of its raw
    logits ``float32 [vocab]`` -- before the bias, penalties, grammar mask, temperature, top-k, top-p and
    min-p, as OpenAI and vLLM's default report them, so whatever the sampler kept, ``n`` alternatives
    (or the vocabulary) are listed. ``{"id", "logprob", "top": [(id, logprob), ...], "sampled_logprob"}``:
    the last is ``token``'s log-probability in ``sampled``, the distribution it was drawn from (the
    trace's), or None without it. Natural log; ties in ``top``: the lower id first."""
    logp = log_softmax(logits)
    n = min(n, len(logp))
    ids = np.argpartition(-logp, n - 1)[:n] if n else np.zeros(0, dtype=np.int64)
    ids = ids[np.lexsort((ids, -logp[ids]))]  # most likely first, then the lower id
    with np.errstate(divide="ignore"):
        drawn = None if sampled is None else float(np.log(np.float64(sampled[token])))
    return {
        "id": int(token),
        "logprob": float(logp[token]),
        "top": [(int(i), float(logp[i])) for i in ids],
        "sampled_logprob": drawn,
    }
