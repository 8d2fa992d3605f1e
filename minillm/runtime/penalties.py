"""The processors that act before the warpers: OpenAI's ``logit_bias`` and frequency and presence
penalties, and a grammar's mask.

Both act on raw logits ``float32 [vocab]`` before transformers' processors (``sampling.py`` runs
them in order). OpenAI documents them as:

    logit_bias          logit[j] += bias[j]        bias in [-100, 100]; -100 bans j, +100 forces it
    frequency/presence  logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty

where ``c[j]`` counts how often id ``j`` was *generated* so far (the prompt does not count: that is
the difference from the repetition penalty, which counts prompt ids too, once each).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from minillm.errors import InvalidRequestError, SamplingParamsError

MAX_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_PENALTY = 2.0  # OpenAI's range for frequency_penalty and presence_penalty


def check_logit_bias(value) -> tuple[tuple[int, float], ...]:
    """``{id: bias}`` (ids as ints or digit strings, as JSON sends them) or ``[(id, bias)]`` -> sorted
    ``((id, bias), ...)``, the hashable form ``SamplingParams`` keeps.

    Raises:
        SamplingParamsError: an id that is not a whole number >= 0, a bias outside [-100, 100].
    """
    if value is None:
        return ()
    pairs = value.items() if isinstance(value, Mapping) else value
    out: dict[int, float] = {}
    for key, bias in pairs:
        try:
            token = int(key) if not isinstance(key, (bool, float)) else None
        except (TypeError, ValueError):
            token = None
        if token is None or token < 0:
            raise SamplingParamsError(
                f"logit_bias key {key!r} is not a token id; use whole numbers >= 0, e.g. {{28: -100}}"
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise SamplingParamsError(f"logit_bias[{token}] must be a number in [-100, 100], got {bias!r}")
        if not -MAX_BIAS <= bias <= MAX_BIAS:
            raise SamplingParamsError(f"logit_bias[{token}] = {bias} is outside [-100, 100] (OpenAI's range)")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def apply_logit_bias(logits, bias: Iterable[tuple[int, float]]) -> np.ndarray:
    """``logits[id] += bias`` for every ``(id, bias)``; a copy ``float32 [vocab]``.

    Example: logits [1, 2, 3], bias {0: 5, 2: -100} -> [6, 2, -97].

    Raises:
        InvalidRequestError: an id outside the vocabulary.
    """
    out = np.array(logits, dtype=np.float32)  # copy
    pairs = list(bias)
    if not pairs:
        return out
    ids = np.array([i for i, _ in pairs], dtype=np.int64)
    if ids.max() >= out.size:
        raise InvalidRequestError(
            f"logit_bias names token id {int(ids.max())}, outside the vocabulary [0, {out.size}); "
            "use ids the model's tokenizer gives"
        )
    out[ids] += np.array([b for _, b in pairs], dtype=np.float32)
    return out


def apply_frequency_presence(logits, generated_ids: Iterable[int], frequency: float, presence: float) -> np.ndarray:
    """OpenAI's penalties: ``logit[j] - c[j] * frequency - (c[j] > 0) * presence``, ``c`` counting
    ``generated_ids`` (the new tokens, not the prompt); a copy ``float32 [vocab]``. Negative
    values encourage repeats instead. Example: logits [1, 1, 1], generated [0, 0, 1], frequency 0.5,
    presence 1 -> [-1, -0.5, 1]."""
    out = np.array(logits, dtype=np.float32)  # copy
    generated = np.asarray(list(generated_ids), dtype=np.int64)
    if (frequency == 0 and presence == 0) or generated.size == 0:
        return out
    counts = np.bincount(generated, minlength=out.size)[: out.size].astype(np.float32)  # [vocab] c[j]
    return out - counts * np.float32(frequency) - (counts > 0) * np.float32(presence)  # -inf stays -inf


def check_penalty(name: str, value) -> None:
    """Raises SamplingParamsError unless ``value`` is a number in OpenAI's [-2, 2]."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SamplingParamsError(f"{name} must be a number in [-2, 2], got {value!r}")
    if not -MAX_PENALTY <= value <= MAX_PENALTY:
        raise SamplingParamsError(f"{name} must be in [-2, 2] (OpenAI's range; 0 disables), got {value}")


def apply_mask(logits, allowed: np.ndarray | None) -> np.ndarray:
    """Forbidden ids -> -inf: ``allowed`` is ``bool [vocab]`` (True: the grammar allows the id), or
    None (no constraint). A copy ``float32 [vocab]``; softmax then renormalises over the allowed ids.

    Raises:
        InvalidRequestError: a mask of another length than the logits.
    """
    out = np.array(logits, dtype=np.float32)  # copy
    if allowed is None:
        return out
    if allowed.shape != out.shape:
        raise InvalidRequestError(f"the mask has shape {allowed.shape} but the logits {out.shape}; one bool per id")
    out[~allowed] = -np.inf
    return out
