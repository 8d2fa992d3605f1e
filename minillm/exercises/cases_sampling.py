"""Unit cases of the sampling processors (``runtime/sampling.py``) and of speculative decoding's
acceptance rule (``runtime/speculative.py``); ``cases.py`` says how every check works."""

from __future__ import annotations

import numpy as np

from minillm.exercises.compare import Failed, case, expect_array, expect_equal, frozen
from minillm.exercises.generated import Context, generated, rng_for, st
from minillm.runtime import sampling as S
from minillm.runtime import speculative as SP


# --- sampling -------------------------------------------------------------------------------------------
def _logits(ctx: Context, seed: int, vocab: int, scale: float = 3.0) -> np.ndarray:
    return (rng_for(ctx, seed).standard_normal(vocab) * scale).astype(np.float32)


def on_generated_logits(ctx: Context, values, one) -> None:
    """``one(logits, value, "generated")`` on generated logits of 12 ids and each generated ``value``."""
    s = st()
    generated(
        ctx,
        s.tuples(s.integers(0, 999), s.sampled_from(list(values))),
        lambda e: one(_logits(ctx, e[0], 12), e[1], "generated"),
    )


def _processor_case(ns, name, logits, *args, mistakes=(), label=""):
    where = f"{label}: " + case(name, logits, *args)
    want = getattr(S, name)(logits.copy(), *args)
    got = getattr(ns, name)(*frozen(logits), *args)
    expect_array(where, got, want, atol=1e-6, rtol=1e-5, mistakes=mistakes)


def check_apply_temperature(ns, ctx: Context) -> None:
    def one(logits, t, label):
        _processor_case(
            ns,
            "apply_temperature",
            logits,
            t,
            label=label,
            mistakes=[("divide the logits by the temperature, do not multiply", lambda: logits * np.float32(t))],
        )

    one(np.array([2.0, 1.0, -1.0], dtype=np.float32), 0.5, "temperature 0.5")
    one(np.array([2.0, 1.0, -np.inf], dtype=np.float32), 2.0, "a masked id stays -inf")
    where = "temperature 0: " + case("apply_temperature", np.zeros(3, np.float32), 0.0)
    try:
        ns.apply_temperature(*frozen(np.zeros(3, np.float32)), 0.0)
    except Exception:  # noqa: BLE001 (any clear refusal will do; the textbook raises SamplingParamsError)
        pass
    else:
        raise Failed(where, "returned a result; temperature 0 must raise (greedy is argmax, handled before this)")
    on_generated_logits(ctx, [0.3, 0.7, 1.0, 1.5, 3.0], one)


def check_apply_top_k(ns, ctx: Context) -> None:
    def one(logits, k, label):
        mistakes = [
            (
                "ties with the k-th largest are kept (compare with its value, not its rank)",
                lambda: _top_k_by_rank(logits, k),
            ),
            (
                "keep the k largest: drop what is below the k-th, not the k-th itself",
                lambda: _top_k_by_rank(logits, k - 1) if k > 1 else None,
            ),
        ]
        _processor_case(ns, "apply_top_k", logits, k, label=label, mistakes=mistakes)

    one(np.array([3.0, 1.0, 2.0, 0.5], dtype=np.float32), 2, "k = 2")
    one(np.array([3.0, 2.0, 2.0, 2.0, 1.0], dtype=np.float32), 2, "ties with the k-th")
    one(np.array([3.0, 1.0, 2.0], dtype=np.float32), 0, "k = 0 disables")
    one(np.array([3.0, 1.0, 2.0], dtype=np.float32), 5, "k above the vocabulary")
    on_generated_logits(ctx, range(1, 13), one)


def _top_k_by_rank(logits, k):
    out = logits.astype(np.float32).copy()
    out[np.argsort(-out, kind="stable")[k:]] = -np.inf
    return out


def _top_p_without_crossing(logits, p):
    probs = S.probabilities(logits)
    order = np.argsort(-probs, kind="stable")
    keep = np.cumsum(probs[order]) < p  # stops before the id whose probability crosses p
    keep[0] = True
    out = logits.astype(np.float32).copy()
    out[order[~keep]] = -np.inf
    return out


def check_apply_top_p(ns, ctx: Context) -> None:
    def one(logits, p, label):
        mistakes = [
            (
                "top-p dropping the token that crosses p: keep ids until their total reaches p, that one included",
                lambda: _top_p_without_crossing(logits, p),
            )
        ]
        _processor_case(ns, "apply_top_p", logits, p, label=label, mistakes=mistakes)

    probs = np.array([0.5, 0.3, 0.15, 0.05])
    one(np.log(probs).astype(np.float32), 0.6, "the docstring's example")
    one(np.log(np.array([0.4, 0.2, 0.2, 0.2])).astype(np.float32), 0.5, "ties at the top-p boundary")
    one(np.log(probs).astype(np.float32), 0.0, "p = 0 keeps the best id")
    one(np.log(probs).astype(np.float32), 1.0, "p = 1 disables")
    on_generated_logits(ctx, [0.1, 0.5, 0.8, 0.9, 0.95], one)


def check_apply_min_p(ns, ctx: Context) -> None:
    def one(logits, min_p, label):
        probs = S.probabilities(logits)
        mistakes = [
            (
                "min_p is relative: drop ids below min_p times the top id's probability",
                lambda: np.where(probs < min_p, -np.inf, logits).astype(np.float32),
            )
        ]
        _processor_case(ns, "apply_min_p", logits, min_p, label=label, mistakes=mistakes)

    one(np.log(np.array([0.6, 0.25, 0.1, 0.05])).astype(np.float32), 0.2, "min_p 0.2 of a top at 0.6")
    one(np.log(np.array([0.6, 0.25, 0.1, 0.05])).astype(np.float32), 0.0, "min_p 0 disables")
    on_generated_logits(ctx, [0.05, 0.1, 0.3, 0.6], one)


def check_apply_repetition_penalty(ns, ctx: Context) -> None:
    def one(logits, seen, penalty, label):
        mistakes = [
            (
                "a negative logit is multiplied by the penalty, not divided (dividing makes it more likely)",
                lambda: _penalty_all_divided(logits, seen, penalty),
            ),
            ("an id seen twice is penalised once", lambda: _penalty_per_occurrence(logits, seen, penalty)),
        ]
        _processor_case(ns, "apply_repetition_penalty", logits, list(seen), penalty, label=label, mistakes=mistakes)

    one(np.array([2.0, -2.0, 0.5], dtype=np.float32), [0, 1], 2.0, "the docstring's example")
    one(np.array([2.0, -2.0, 0.5], dtype=np.float32), [0, 0, 1, 0], 2.0, "an id seen three times")
    one(np.array([2.0, -2.0, 0.5], dtype=np.float32), [], 2.0, "nothing seen")
    s = st()
    generated(
        ctx,
        s.tuples(s.integers(0, 999), s.lists(s.integers(0, 11), max_size=8), s.sampled_from([1.1, 1.5, 2.0])),
        lambda e: one(_logits(ctx, e[0], 12), e[1], e[2], "generated"),
    )


def _penalty_all_divided(logits, seen, penalty):
    out = logits.astype(np.float32).copy()
    ids = np.unique(np.asarray(seen, dtype=np.int64))
    out[ids] = out[ids] / np.float32(penalty)
    return out


def _penalty_per_occurrence(logits, seen, penalty):
    out = logits.astype(np.float32).copy()
    for i in seen:
        out[i] = out[i] / np.float32(penalty) if out[i] > 0 else out[i] * np.float32(penalty)
    return out


# --- speculative decoding ------------------------------------------------------------------------------
def _dist(ctx: Context, seed: int, vocab: int) -> np.ndarray:
    x = rng_for(ctx, seed).random(vocab) ** 3
    return x / x.sum()


def check_acceptance_probability(ns, ctx: Context) -> None:
    def one(p, q, x, label):
        where = f"{label}: " + case("acceptance_probability", p, q, x)
        mistakes = [
            (
                "min(1, p(x) / q(x)): a probability is at most 1",
                lambda: float(p[x] / q[x]) if q is not None and q[x] > 0 else None,
            )
        ]
        args = frozen(p) + ((None,) if q is None else frozen(q))
        expect_equal(where, ns.acceptance_probability(*args, x), SP.acceptance_probability(p, q, x), mistakes=mistakes)

    p = np.array([0.5, 0.3, 0.2])
    one(p, np.array([0.25, 0.5, 0.25]), 0, "p(x) > q(x): always kept")
    one(p, np.array([0.25, 0.5, 0.25]), 1, "p(x) < q(x)")
    one(p, None, 2, "a one-hot draft (q None)")
    one(p, np.array([0.5, 0.5, 0.0]), 2, "a draft with q(x) = 0")
    s = st()
    generated(
        ctx,
        s.tuples(s.integers(0, 999), s.integers(0, 7)),
        lambda e: one(_dist(ctx, e[0], 8), _dist(ctx, e[0] + 1, 8), e[1], "generated"),
    )


def check_residual(ns, ctx: Context) -> None:
    def one(p, q, x, label):
        where = f"{label}: " + case("residual", p, q, x)
        qq = np.eye(1, len(p), x)[0] if q is None else q
        mistakes = [
            ("normalize: the residual max(0, p - q) must sum to 1", lambda: np.maximum(p - qq, 0)),
            ("clip at 0 before normalizing: max(0, p - q)", lambda: (p - qq) / (p - qq).sum()),
        ]
        args = frozen(p) + ((None,) if q is None else frozen(q))
        got = ns.residual(*args, x)
        expect_array(
            where,
            np.asarray(got, dtype=np.float64) if isinstance(got, np.ndarray) else got,
            SP.residual(p, q, x),
            atol=1e-9,
            rtol=1e-7,
            mistakes=mistakes,
        )

    p = np.array([0.5, 0.3, 0.2])
    one(p, np.array([0.25, 0.5, 0.25]), 1, "a rejection")
    one(p, None, 0, "a one-hot draft (q None)")
    one(p, p.copy(), 0, "p == q (nothing is ever rejected)")
    s = st()
    generated(
        ctx,
        s.tuples(s.integers(0, 999), s.integers(0, 7)),
        lambda e: one(_dist(ctx, e[0], 8), _dist(ctx, e[0] + 1, 8), e[1], "generated"),
    )


#: unit -> its unit cases.
