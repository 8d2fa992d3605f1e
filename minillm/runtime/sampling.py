"""Logits -> one token id.

The model's last position gives one score (logit) per vocabulary entry, ``float32 [vocab]``.
Sampling turns those scores into a choice in small steps, each a pure function you can call
on its own in a notebook. ``process_logits`` applies them in this order: OpenAI's processors on the
raw logits first (``penalties.py``; OpenAI's API reference adds ``logit_bias`` to the model's logits
and subtracts its penalties from them), then a grammar's mask, then transformers' warpers in
transformers' order (``generation/utils.py: _get_logits_processor``; ``generation/logits_process.py``):

    0. logit bias           add a bias in [-100, 100] per id                OpenAI logit_bias
    1. repetition penalty   make ids already seen (prompt too) less likely  RepetitionPenaltyLogitsProcessor
    2. frequency, presence  subtract c*f + (c>0)*p, c = times generated      OpenAI's penalties
    3. constraint mask      ids the grammar forbids -> -inf                  (constraint.py)
    4. temperature          divide: < 1 sharpens, > 1 flattens              TemperatureLogitsWarper
    5. top-k                keep the k highest                              TopKLogitsWarper
    6. top-p (nucleus)      keep the fewest reaching probability p          TopPLogitsWarper
    7. min-p                drop those < min_p * the best's prob            MinPLogitsWarper

Removed entries become ``-inf``, so softmax gives them probability exactly 0. Then ``sample``
draws one id from softmax of what is left -- or, at temperature 0, takes the argmax (greedy).

Numerics: no valid setting gives NaN or infinite probabilities, nor overflows on the way; a step
whose scaled logits (or their distance) leave float32's range is measured from its largest logit,
greedy when that one left it, and a NaN logit is an error (``numerics.py`` says why).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from minillm.errors import InvalidRequestError, SamplingParamsError
from minillm.model.primitives import softmax  # noqa: F401 (the one softmax, re-exported for lessons and tests)
from minillm.runtime.candidates import model_logprobs, top_candidates  # noqa: F401 (re-exported)
from minillm.runtime.numerics import as_float32_value, as_logits, limit_or_float32, probabilities  # noqa: F401
from minillm.runtime.penalties import (
    apply_frequency_presence,
    apply_logit_bias,
    apply_mask,
    check_logit_bias,
    check_penalty,
)


def _whole(value, low: int, high: float = math.inf) -> bool:
    """True for an int (not a bool) in [low, high]."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and low <= value <= high


@dataclass(frozen=True)
class SamplingParams:
    """How to choose the next token. Defaults mean "sample from the model's own distribution".

    temperature         >= 0; 0 means greedy (argmax), 1 leaves logits unchanged
    top_k               >= 0; 0 disables
    top_p               in [0, 1]; 1 disables, 0 keeps only the most likely id
    min_p               in [0, 1]; 0 disables
    repetition_penalty  > 0; 1 disables, > 1 discourages repeats (CTRL paper, as transformers)
    seed                int >= 0 or None; used only when ``sample`` gets no rng
    frequency_penalty   in [-2, 2]; 0 disables; subtracted once per time an id was generated (OpenAI)
    presence_penalty    in [-2, 2]; 0 disables; subtracted once from every id generated at all (OpenAI)
    logit_bias          {id: bias in [-100, 100]} added to the raw logits (OpenAI); kept as sorted pairs
    top_logprobs        None: no logprobs; 0..20: record each new token's log-probability and the
                        that-many most likely alternatives (``GenerationResult.logprobs``), in the
                        model's own distribution, before any processor (OpenAI's, vLLM's default)

    Raises SamplingParamsError naming the value and its allowed range.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_logprobs: int | None = None

    def __post_init__(self):
        def number(name: str) -> float:
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float, np.integer, np.floating))
                or not math.isfinite(value)
            ):
                raise SamplingParamsError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        if number("temperature") < 0:
            raise SamplingParamsError(
                f"temperature must be >= 0, got {self.temperature}; "
                "use 0 for greedy, 1 for the model's own distribution"
            )
        if not _whole(self.top_k, 0):
            raise SamplingParamsError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not 0.0 <= number("top_p") <= 1.0:
            raise SamplingParamsError(f"top_p must be in [0, 1] (1 disables), got {self.top_p}")
        if not 0.0 <= number("min_p") <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1] (0 disables), got {self.min_p}")
        if number("repetition_penalty") <= 0:
            raise SamplingParamsError(
                f"repetition_penalty must be > 0 (1 disables, > 1 discourages repeats), got {self.repetition_penalty}"
            )
        if self.seed is not None and not _whole(self.seed, 0):
            raise SamplingParamsError(f"seed must be an integer >= 0 or None, got {self.seed!r}")
        check_penalty("frequency_penalty", self.frequency_penalty)
        check_penalty("presence_penalty", self.presence_penalty)
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))  # frozen: normalise once
        if (n := self.top_logprobs) is not None and not _whole(n, 0, 20):
            raise SamplingParamsError(f"top_logprobs must be None or a whole number in [0, 20] (OpenAI's), got {n!r}")

    @classmethod
    def from_fields(cls, source: object) -> SamplingParams:
        """The params named by ``source``'s attributes of the same names (a CLI's parsed arguments, an
        HTTP request's body): ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
        ``seed``, and if present ``frequency_penalty``, ``presence_penalty``, ``logit_bias``, ``top_logprobs``
        (None: none).
        Raises SamplingParamsError as the constructor does."""
        names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
        fields = {name: getattr(source, name) for name in names}
        for name in ("frequency_penalty", "presence_penalty", "logit_bias", "top_logprobs"):
            if getattr(source, name, None) is not None:
                fields[name] = getattr(source, name)
        return cls(**fields)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


#: What every lifecycle function does when given no ``SamplingParams``: take the argmax (as
#: transformers' ``generate`` without ``do_sample``). ``SamplingParams()`` itself asks to sample.
GREEDY = SamplingParams(temperature=0.0)


class SeedWithoutRngWarning(UserWarning):
    """``sample(logits, SamplingParams(seed=...))`` with no ``rng``: each call restarts the generator."""


def apply_repetition_penalty(logits, seen_ids: Iterable[int], penalty: float) -> np.ndarray:
    """Penalise every id in ``seen_ids`` once (duplicates count once; prompt ids count too).

    A positive logit is divided by ``penalty``, a negative one multiplied, so both move toward
    "less likely" (dividing a negative would make it *more* likely).
    Example: logits [2, -2, 0.5], seen {0, 1}, penalty 2 -> [1, -4, 0.5].
    """
    out = as_logits(logits)
    if penalty == 1.0:
        return out
    ids = np.unique(np.asarray(list(seen_ids), dtype=np.int64))  # sorted, each id once
    if ids.size == 0:
        return out
    if ids[0] < 0 or ids[-1] >= out.size:
        bad = ids[0] if ids[0] < 0 else ids[-1]
        raise InvalidRequestError(f"seen id {bad} is outside the vocabulary [0, {out.size})")
    # In float64 with transformers' float32 penalty: the same float32 results (double rounding is
    # harmless for one * or /), and a tiny penalty's overflow is seen instead of becoming inf.
    p = as_float32_value(penalty)
    picked = out[ids].astype(np.float64)
    with np.errstate(over="ignore", under="ignore"):
        scaled = out.astype(np.float64)
        scaled[ids] = np.where(picked < 0, picked * p, picked / p)
    return limit_or_float32(scaled)


def apply_temperature(logits, temperature: float) -> np.ndarray:
    """Divide logits by ``temperature`` (> 0). Temperature 0 is greedy: handle it before this.

    A temperature so small that the scaled logits, or the distance between two, leave float32's
    range (``3 / 1e-40``; ``0.01 / 1e-40`` and ``-0.03 / 1e-40``) gives them measured from the
    largest: it at 0, those further below than float32's range at -inf (``numerics.py``).
    """
    if not temperature > 0:
        raise SamplingParamsError(f"apply_temperature needs temperature > 0, got {temperature}; use argmax for 0")
    out = as_logits(logits)
    if temperature == 1.0:
        return out
    # transformers divides float32 by float32(t); in float64 the result rounds the same, and an
    # overflow shows instead of turning every positive logit into the same inf.
    t = as_float32_value(temperature)
    with np.errstate(over="ignore", under="ignore"):
        scaled = out.astype(np.float64) / t
    return limit_or_float32(scaled)


def apply_top_k(logits, k: int) -> np.ndarray:
    """Keep the ``k`` highest logits (ties with the k-th are kept, as transformers); 0 disables."""
    out = as_logits(logits)
    if k <= 0 or k >= out.size:
        return out
    kth = np.partition(out, out.size - k)[out.size - k]  # the k-th largest value, O(vocab)
    out[out < kth] = -np.inf
    return out


def apply_top_p(logits, p: float) -> np.ndarray:
    """Nucleus: keep the smallest set of highest-probability ids whose probability reaches ``p``.

    As transformers' ``TopPLogitsWarper``: sort from least to most likely, accumulate the
    probabilities (float32), and drop every id whose running total is still ``<= 1 - p``; the most
    likely id is always kept (so ``p = 0`` is greedy-like). ``p = 1`` disables. Tied ids are ordered
    by id, least likely first (torch's sort does the same for up to 16 ids; above that its order
    among exact ties is unspecified), so of two tied ids at the cut the later one stays.
    Example: probabilities [0.5, 0.3, 0.15, 0.05], p 0.6 -> ids {0, 1}, renormalised [0.625, 0.375].
    """
    out = as_logits(logits)
    if p >= 1.0:
        return out
    order = np.argsort(out, kind="stable")  # least likely first
    cumulative = np.cumsum(probabilities(out[order]))  # [vocab] float32, running total from the bottom
    drop = cumulative <= np.float32(1.0 - p)
    drop[-1] = False  # never remove the best id (transformers' min_tokens_to_keep=1)
    out[order[drop]] = -np.inf
    return out


def apply_min_p(logits, min_p: float) -> np.ndarray:
    """Drop ids whose probability is below ``min_p`` times the top id's probability; 0 disables."""
    out = as_logits(logits)
    if min_p <= 0.0:
        return out
    probs = probabilities(out)
    with np.errstate(under="ignore"):  # min_p * a small max prob may round to a subnormal
        out[probs < np.float32(min_p) * probs.max()] = -np.inf
    return out


def penalize(logits, params: SamplingParams, seen_ids=(), generated_ids=(), allowed=None) -> np.ndarray:
    """Steps 0-3 of the module's list: logit bias, repetition penalty (``seen_ids``: prompt + new),
    frequency and presence penalties (``generated_ids``: new ids only), the mask. ``float32 [vocab]``."""
    out = apply_logit_bias(as_logits(logits), params.logit_bias)
    out = apply_repetition_penalty(out, seen_ids, params.repetition_penalty)
    out = apply_frequency_presence(out, generated_ids, params.frequency_penalty, params.presence_penalty)
    return apply_mask(out, allowed)


def process_logits(
    logits, params: SamplingParams, seen_ids: Iterable[int] = (), generated_ids: Iterable[int] = (), allowed=None
) -> np.ndarray:
    """All processors in the module's order -> ``float32 [vocab]`` with removed ids at -inf.

    ``seen_ids``: prompt + new ids (repetition penalty); ``generated_ids``: new ids (frequency and
    presence penalties); ``allowed``: a grammar's ``bool [vocab]`` mask or None. At temperature 0
    the temperature step is skipped. (Greedy itself takes the argmax of the penalised logits, as
    transformers does without ``do_sample``: the filters apply to sampling.)
    """
    return _warp(penalize(logits, params, seen_ids, generated_ids, allowed), params)


def _warp(out: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature (unless greedy), top-k, top-p, min-p on already penalised logits ``[vocab]``."""
    if not params.greedy:
        out = apply_temperature(out, params.temperature)
    out = apply_top_k(out, params.top_k)
    out = apply_top_p(out, params.top_p)
    return apply_min_p(out, params.min_p)


def sample(
    logits,
    params: SamplingParams,
    rng: np.random.Generator | None = None,
    seen_ids: Iterable[int] = (),
    generated_ids: Iterable[int] = (),
    allowed: np.ndarray | None = None,
) -> int:
    """Choose the next token id from ``float32 [vocab]`` logits.

    Temperature 0: argmax after the bias, penalties and mask (no division by zero, no randomness).
    Otherwise: one draw from ``softmax(process_logits(...))`` using only ``rng``.

    Make one generator per request and pass it to every call, as ``generate`` does::

        rng = np.random.default_rng(params.seed)
        for step in ...:
            tok = sample(logits, params, rng)

    With ``rng=None`` a fresh ``np.random.default_rng(params.seed)`` is made on each call, so in a
    loop every step draws the *same* random number; with a seed set this warns
    (:class:`SeedWithoutRngWarning`) rather than keep a hidden generator that two requests sharing
    the same params would also share.

    Raises:
        InvalidRequestError: NaN logits, all logits ``-inf`` (after the mask too), a seen id or a
            logit_bias id outside the vocabulary.
    """
    return _choose(logits, params, rng, seen_ids, generated_ids, allowed, keep_probs=False)[0]


def sample_with_probs(logits, params: SamplingParams, *args, **kwargs) -> tuple[int, np.ndarray]:
    """:func:`sample` (the same arguments, the same token), also returning the distribution it
    chose from: ``float32 [vocab]``.

    At temperature 0 the distribution is the penalised (and masked) logits' softmax at temperature
    1, unfiltered: greedy takes its argmax, and like transformers without ``do_sample`` it applies
    no top-k / top-p / min-p. The trace shows these probabilities; computing them costs a softmax
    over the vocabulary, so :func:`sample` skips it at temperature 0.
    """
    return _choose(logits, params, *args, **kwargs, keep_probs=True)


def _choose(logits, params, rng=None, seen_ids=(), generated_ids=(), allowed=None, *, keep_probs: bool):
    """The one path of :func:`sample` and :func:`sample_with_probs`: ``(token, probs)``, probs None
    when greedy and not ``keep_probs``."""
    penalized = penalize(logits, params, seen_ids, generated_ids, allowed)
    if params.greedy:
        return int(np.argmax(penalized)), probabilities(penalized) if keep_probs else None
    probs = probabilities(_warp(penalized, params))
    return _draw(probs, _rng_for(params, rng)), probs


def _rng_for(params: SamplingParams, rng: np.random.Generator | None) -> np.random.Generator:
    """``rng``, or a fresh generator from the seed (warning when a seed is set: see :func:`sample`)."""
    if rng is not None:
        return rng
    if params.seed is not None:
        warnings.warn(
            f"sample() got SamplingParams(seed={params.seed}) but no rng: a new generator is made from the "
            "seed on every call, so each step of a loop draws the same number. Make one per request, "
            "rng = np.random.default_rng(params.seed), and pass it to every sample() call",
            SeedWithoutRngWarning,
            stacklevel=4,  # the caller of sample() / sample_with_probs()
        )
    return np.random.default_rng(params.seed)


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from ``probs`` ``[vocab]``: the first id whose cumulative probability passes
    u. Ids at probability 0 add nothing to the running sum, so they can never be the one that passes it."""
    p64 = probs.astype(np.float64)
    cdf = np.cumsum(p64)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), np.flatnonzero(p64)[-1]))


def candidates(
    logits, params: SamplingParams, seen_ids: Iterable[int] = (), k: int = 5, generated_ids: Iterable[int] = ()
) -> list[tuple[int, float]]:
    """The ``k`` most likely ids of the distribution :func:`sample` chooses from, with their
    probabilities (for traces; see :func:`sample_with_probs`)."""
    probs = sample_with_probs(logits, params, np.random.default_rng(0), seen_ids, generated_ids)[1]
    return top_candidates(probs, k)
