"""Speculative decoding: a cheap draft proposes ``k`` tokens, the model checks them all in one pass.

Decode is sequential: each new token costs one pass over every weight. A draft guesses the next
``k`` tokens cheaply; the model then reads ``[last, d1 .. dk]`` from the request's cache in ONE
forward pass (a short prefill) and gets its own distributions ``p_1 .. p_{k+1}`` for all of them::

    draft:    d1 .. dk (and q_1 .. q_k, what the draft sampled them from)     drafts.py
    verify:   logits = forward([last, d1 .. dk], cache)      [k + 1, vocab]: p_1 .. p_{k+1}
    accept:   greedy   d_i while d_i == argmax p_i; then argmax p_i
              sampled  d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
                       one token from norm(max(0, p_i - q_i)); every d_i accepted: a bonus from p_{k+1}
    roll back cache.truncate(positions of last and the accepted drafts)

A pass gives 1 to ``k + 1`` tokens, and the tokens have exactly the model's distribution: the
accepted part contributes ``min(p, q)``, the rejection ``max(0, p - q)``, and they add up to ``p``
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al.
2023, "Accelerating LLM Decoding with Speculative Sampling"). A deterministic draft (prompt lookup)
has ``q`` one-hot on its token. ``p`` and ``q`` go through the request's own processors
(repetition penalty, temperature, top-k, top-p, min-p), each row with the drafted tokens before it
counted as seen. If each drafted token is accepted with probability ``α``, a pass yields
``(1 - α^(k+1)) / (1 - α)`` tokens on average (:func:`expected_tokens_per_pass`); ``α`` is measured per
position checked (:func:`per_position_acceptance`): the drafts after a pass's first rejection are never
checked, so they say nothing about ``α``.

A drafted row is not free: it goes through every layer's products, which on a CPU cost a
fraction of a one-row pass each, and a rejected row is that work lost. So ``k`` adapts
(:func:`next_k`): it starts at 1, grows by one while every draft is kept, falls to one past the
kept run at a rejection (by one when nothing was kept), never above ``num_tokens``; and a draft
with nothing to propose (prompt lookup without a match) gives up for that step, a plain decode
step. ``adaptive=False`` drafts ``num_tokens`` every pass (the formula's fixed ``k``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from minillm.errors import InvalidRequestError
from minillm.runtime import sampling
from minillm.runtime.drafts import Draft, make_draft
from minillm.runtime.sampling import SamplingParams

#: the most tokens a draft may propose per verification pass
MAX_SPECULATIVE_TOKENS = 16
DRAFTS = ("ngram", "self-int8", "self-gguf", "layers:K")


@dataclass(frozen=True)
class Speculative:
    """How a request drafts: ``draft`` (``"ngram"`` | ``"self-int8"`` | ``"self-gguf"`` |
    ``"layers:K"`` | a :class:`~minillm.runtime.drafts.Draft`), ``num_tokens`` drafted per pass
    (1..``MAX_SPECULATIVE_TOKENS``; the most with ``adaptive``, see :func:`next_k`), and for
    ``ngram`` the n-gram lengths tried, longest first (``prompt_lookup_max`` down to
    ``prompt_lookup_min``: a match of one token is too weak a guess to pay for its row).

    Raises:
        InvalidRequestError: a value out of range or an unknown draft, naming it and the choices.
    """

    draft: str | Draft = "ngram"
    num_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 2
    adaptive: bool = True

    def __post_init__(self):
        k = self.num_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequestError(
                f"num_tokens (speculative tokens per pass) must be a whole number in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {k!r}."
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (lo, hi)) or not 1 <= lo <= hi:
            raise InvalidRequestError(
                f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}."
            )
        if isinstance(self.draft, str):
            layers = self.draft.removeprefix("layers:")
            if self.draft not in DRAFTS[:3] and not (self.draft.startswith("layers:") and layers.isdigit()):
                raise InvalidRequestError(
                    f"unknown draft {self.draft!r}; the drafts are {', '.join(DRAFTS)} (K: the first K layers), "
                    "or a minillm.runtime.drafts.Draft object."
                )
        elif not callable(getattr(self.draft, "propose", None)):
            raise InvalidRequestError(
                f"draft {self.draft!r} has no propose(tokens, k, choose) method; subclass minillm.runtime.drafts.Draft."
            )

    @classmethod
    def of(cls, value) -> Speculative | None:
        """A request's ``speculative=`` option: None (off), a draft name, a Draft, or a Speculative."""
        if value is None or isinstance(value, Speculative):
            return value
        return cls(draft=value)


def next_k(k: int, drafted: int, accepted: int, most: int) -> int:
    """The drafts to propose next pass, after ``accepted`` of ``drafted`` were kept with ``k`` asked:
    every one kept (and any at all drafted): ``k + 1``, at most ``most``; some kept: ``accepted + 1``
    (the run that worked, one more); none kept: ``k - 1``, at least 1. Nothing drafted: ``k``."""
    if drafted == 0:
        return k
    if accepted == drafted:
        return min(most, k + 1)
    return max(1, accepted + 1 if accepted else k - 1)


# --- what a pass yields, in expectation ------------------------------------------------------------
def per_position_acceptance(kept: int, rejections: int) -> float:
    """``α``: the share of checked draft positions that were kept, ``kept / (kept + rejections)``.

    A pass checks its drafts in order and stops at the first rejection, so the positions checked are
    the kept drafts plus one per rejecting pass; the drafts after a rejection were never checked.
    (``kept / drafted`` counts those unchecked drafts as failures and underestimates ``α``.) This is
    the maximum-likelihood ``α`` of the independent-acceptance model behind
    :func:`expected_tokens_per_pass` (Leviathan et al. 2023, section 3.1).

    Args:
        kept: drafts accepted (``RequestMetrics.accepted_tokens``), a count >= 0.
        rejections: passes that rejected a draft (``RequestMetrics.rejections``), a count >= 0.

    Returns:
        ``α`` in [0, 1] as a float; NaN when nothing was checked.
    """
    checked = kept + rejections
    return kept / checked if checked else float("nan")


def expected_tokens_per_pass(alpha: float, k: float) -> float:
    """``1 + α + α² + ... + α^k = (1 - α^(k+1)) / (1 - α)``: the tokens a verification pass of ``k`` drafts
    yields on average when each draft is kept independently with probability ``alpha`` (its kept run,
    then one token of the model's own); ``k + 1`` at ``α = 1``. Leviathan et al. 2023, equation 1."""
    return k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


# --- the acceptance rule: pure functions on distributions ------------------------------------------
def acceptance_probability(p: np.ndarray, q: np.ndarray | None, x: int) -> float:
    """``min(1, p(x) / q(x))``: the chance a drafted ``x`` is kept; ``q`` None: one-hot on ``x``, so ``p(x)``.
    ``p``, ``q``: ``[vocab]`` probabilities."""
    px, qx = float(p[x]), 1.0 if q is None else float(q[x])
    if qx <= 0.0:  # a draft proposing what it gave no probability: the ratio is infinite (or 0 / 0)
        return 1.0 if px > 0.0 else 0.0
    return min(1.0, px / qx)


def residual(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """``norm(max(0, p - q))`` ``[vocab]`` float64: what a rejection samples from (``q`` None: one-hot on
    ``x``). When ``p <= q`` everywhere (``p == q``) nothing is ever rejected; ``p`` is returned."""
    q = np.eye(1, len(p), x, dtype=np.float64)[0] if q is None else q
    r = np.maximum(np.asarray(p, dtype=np.float64) - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else np.asarray(p, dtype=np.float64)


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One id from ``probs`` ``[vocab]`` by inverse CDF, as ``sampling.sample`` draws."""
    cdf = np.cumsum(probs, dtype=np.float64)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), np.flatnonzero(probs)[-1]))


def verify(
    p_of: Callable[[int], np.ndarray],
    q: np.ndarray | None,
    drafted: Sequence[int],
    rng: np.random.Generator,
) -> tuple[int, int]:
    """The sampled acceptance rule over ``k`` drafted ids.

    Args:
        p_of: ``i -> p_i`` ``[vocab]``, the model's distribution after the first ``i`` drafts
            (computed only as far as needed).
        q: ``[k, vocab]`` the draft's distributions, or None for a deterministic draft.
        drafted: the ``k`` ids.

    Returns:
        ``(accepted, token)``: how many drafts are kept, and the token after them (resampled from
        the residual at the first rejection, or the bonus from ``p_k``).
    """
    for i, x in enumerate(drafted):
        p = p_of(i)
        q_i = None if q is None else q[i]
        if rng.random() >= acceptance_probability(p, q_i, x):
            return i, draw(residual(p, q_i, x), rng)
    return len(drafted), draw(p_of(len(drafted)), rng)


def verify_greedy(best_of: Callable[[int], int], drafted: Sequence[int]) -> tuple[int, int]:
    """Greedy: keep drafts while each equals the model's argmax ``best_of(i)``; then that argmax."""
    for i, x in enumerate(drafted):
        best = best_of(i)
        if best != x:
            return i, best
    return len(drafted), best_of(len(drafted))


def distribution(logits: np.ndarray, params: SamplingParams, seen, generated=(), allowed=None) -> np.ndarray:
    """What :func:`sampling.sample` draws from: ``softmax(process_logits(...))`` as float64 ``[vocab]``;
    ``seen``: every id so far (the repetition penalty's), ``generated``: the new ones (OpenAI's penalties'),
    ``allowed``: a constraint's ``bool [vocab]`` mask (None: every id)."""
    return sampling.probabilities(sampling.process_logits(logits, params, seen, generated, allowed)).astype(np.float64)


def along_grammar(state, ids: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """Walk a constraint's matcher (``constraint.ConstraintState``) along drafted ``ids`` and back.

    Returns ``(kept, masks)``: the drafts up to the first the grammar refuses, or the first after
    which it would force a run (the request appends a forced run itself, after a pushed token), or
    an EOS (kept, nothing after it); and ``masks[i]``, the ``bool [vocab]`` mask after the first
    ``i`` kept drafts, ``len(kept) + 1`` of them: what the model's row ``i`` is sampled under. The
    matcher is left where it started (``rollback``)."""
    masks, kept, consumed = [state.allowed()], 0, 0
    try:
        for x in ids:
            if not masks[-1][x]:
                break
            if x in state.eos:  # an allowed EOS ends the output: kept, and its row is never pushed
                return ids[: kept + 1], [*masks, None]
            state.consume(x)
            consumed += 1
            if state.forced():  # the grammar allows one way on after x: the request adds that run itself
                break
            kept += 1
            masks.append(state.allowed())
    finally:
        state.matcher.rollback(consumed)
    return ids[:kept], masks


# --- one request's speculation ---------------------------------------------------------------------
@dataclass(frozen=True)
class Proposal:
    """A draft's proposal for one pass: ``ids`` (the ``k`` drafted ids; none: a plain decode step), ``q``
    ``[k, vocab]`` float64 (what each was drawn from; None: a deterministic draft) and ``masks``, the
    constraint's ``bool [vocab]`` mask for each of the ``k + 1`` verified rows (None: no constraint)."""

    ids: list[int] = field(default_factory=list)
    q: np.ndarray | None = None
    masks: list[np.ndarray | None] = field(default_factory=lambda: [None])


class Chooser:
    """How a model draft picks its tokens (a ``drafts.Choose``): the request's processors (``params``,
    ``rng``; the ids past the first ``n_prompt`` count as generated), and a constraint's mask as far as the
    grammar walks without a forced run. Greedy gives no ``q``. :meth:`stop` rolls the walk back."""

    def __init__(self, params: SamplingParams, rng, n_prompt: int, constraint=None):
        self.params, self.rng, self.n_prompt, self.constraint = params, rng, n_prompt, constraint
        self.walk: int | None = None if constraint is None else 0  # the tokens walked in the grammar

    def __call__(self, logits: np.ndarray, seen) -> tuple[int, np.ndarray | None]:
        generated = list(seen)[self.n_prompt :]  # the ids past the prompt: OpenAI's penalties count these
        grammar = self.constraint
        allowed = grammar.allowed() if self.walk is not None else None
        if self.params.greedy:
            token, q = sampling.sample(logits, self.params, self.rng, seen, generated, allowed), None
        else:
            q = distribution(logits, self.params, seen, generated, allowed)
            token = draw(q, self.rng)
        if self.walk is not None:  # follow the draft in the grammar; stop at an EOS or before a forced run
            if token not in grammar.eos:
                grammar.consume(token)
                self.walk += 1
            if token in grammar.eos or grammar.forced():
                self.stop()
        return token, q

    def stop(self) -> None:
        """End the walk in the grammar (the draft's later tokens unmasked: ``along_grammar`` cuts them)."""
        if self.walk:
            self.constraint.matcher.rollback(self.walk)
        self.walk = None


class SpeculativeDecoder:
    """One request's draft and its adaptive ``k`` (:func:`next_k`). It holds no request: :meth:`propose`
    takes the ids so far and the request's sampler as arguments and returns a :class:`Proposal`;
    :func:`accept` applies the rule to a verification's logits; :meth:`adapt` moves ``k`` on. The
    request appends the tokens (``speculative_step.settle``).

    Args:
        spec: the request's :class:`Speculative`; ``model``: the loaded model (a model draft is built from
            it); ``max_seq_len``: the request's window (a model draft's own cache).
    """

    def __init__(self, spec: Speculative, model, max_seq_len: int):
        self.spec, self.vocab = spec, model.config.vocab_size
        self.draft = make_draft(spec, model, max_seq_len)
        self.k = 1 if spec.adaptive else spec.num_tokens  # drafts asked for next pass (next_k)

    def propose(self, tokens, most: int, params: SamplingParams, rng, n_prompt: int, constraint=None) -> Proposal:
        """The draft's ids after ``tokens`` (prompt + new ids), at most ``k`` and ``most`` (the room the
        request has); ``constraint``: a ``constraint.ConstraintState`` the drafts must follow (cut at the
        first it refuses, see :func:`along_grammar`). Nothing proposed: an empty :class:`Proposal`.

        Raises:
            InvalidRequestError: a draft proposing ids (or a ``q``) outside the model's vocabulary.
        """
        k = max(0, min(self.k, most))
        if k == 0:
            return Proposal()
        choose = Chooser(params, rng, n_prompt, constraint)  # a model draft's tokens follow the grammar too
        try:
            ids, q = self.draft.propose(list(tokens), k, choose)
        finally:
            choose.stop()
        ids = [int(i) for i in ids][:k]
        if any(not 0 <= i < self.vocab for i in ids) or (q is not None and np.shape(q)[1:] != (self.vocab,)):
            raise InvalidRequestError(
                f"draft {self.draft!r} proposed ids {ids} / q of shape {np.shape(q)} outside the model's "
                f"vocabulary of {self.vocab}; a draft must share the model's tokenizer."
            )
        masks = [None] * (len(ids) + 1)
        if constraint is not None and ids:
            ids, masks = along_grammar(constraint, ids)
        return Proposal(ids, None if q is None or not ids else np.asarray(q, dtype=np.float64)[: len(ids)], masks)

    def adapt(self, drafted: int, accepted: int) -> None:
        """After a verification that kept ``accepted`` of ``drafted``: ``k`` for the next pass (:func:`next_k`)."""
        if self.spec.adaptive:
            self.k = next_k(self.k, drafted, accepted, self.spec.num_tokens)

    def release(self) -> None:
        self.draft.release()


def accept(logits, proposal: Proposal, params: SamplingParams, rng, seen, generated) -> tuple[int, int]:
    """Apply the rule to a verification's logits ``[k + 1, vocab]`` (an array, or a ``steps.RowLogits``
    whose rows are scored as the rule reaches them): ``(accepted, token)``, the drafts kept and the token
    after them. ``seen``: the ids so far (the repetition penalty's), ``generated``: the new ones; row ``i``
    counts the first ``i`` drafts as seen, under ``proposal.masks[i]``."""
    ids, masks, seen, new = proposal.ids, proposal.masks, list(seen), list(generated)
    if params.greedy:
        return verify_greedy(
            lambda i: sampling.sample(logits[i], params, None, seen + ids[:i], new + ids[:i], masks[i]), ids
        )
    p_of = lambda i: distribution(logits[i], params, seen + ids[:i], new + ids[:i], masks[i])  # noqa: E731
    return verify(p_of, proposal.q, ids, rng)


def shown_probs(logits: np.ndarray, params: SamplingParams, seen, generated, allowed=None) -> np.ndarray:
    """The distribution plain decoding would show for the next token after ``seen`` (``generated`` the new
    ids), float32 ``[vocab]`` as ``sampling.sample_with_probs`` gives it, for logprobs and the trace: the
    model's own ``p`` at that row, whether the token is a kept draft, a resample or the bonus (each has
    ``p``'s distribution)."""
    if params.greedy:  # greedy shows the penalised logits' softmax, unfiltered (as sample_with_probs)
        return sampling.probabilities(sampling.penalize(logits, params, seen, generated, allowed))
    return sampling.probabilities(sampling.process_logits(logits, params, seen, generated, allowed))
