"""Unit cases of the forward's units: the masks, softmax, RMSNorm, RoPE, SiLU and attention, against
``minillm/model/primitives.py`` (``cases.py`` says how every check works)."""

from __future__ import annotations

import numpy as np

from minillm.exercises.compare import Failed, case, expect_array, frozen
from minillm.exercises.generated import Context, generated, rng_for, st
from minillm.model import primitives as T


# --- masks ---------------------------------------------------------------------------------------
def _mask_from(visible: np.ndarray) -> np.ndarray:
    return np.where(visible, np.float32(0), np.float32(-np.inf)).astype(np.float32)


def _positions(seq: int, ctx: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    return offset + np.arange(seq)[:, None], np.arange(ctx)[None, :]


def check_causal_mask(ns, ctx: Context) -> None:
    def one(seq, ctx_len, offset, label):
        where = f"{label}: " + case("causal_mask", seq, ctx_len, offset=offset)
        q, k = _positions(seq, ctx_len, offset)
        mistakes = [
            ("the diagonal masked: a query sees its own key too (key <= query, not <)", lambda: _mask_from(k < q)),
            ("the offset ignored: row i sits at position offset + i", lambda: _mask_from(k <= q - offset)),
        ]
        got = ns.causal_mask(seq, ctx_len, offset=offset)
        expect_array(where, got, T.causal_mask(seq, ctx_len, offset=offset), atol=0, rtol=0, mistakes=mistakes)

    one(4, 4, 0, "prefill of 4")
    one(1, 1, 0, "position 0")
    one(1, 5, 4, "a decode step at position 4")
    one(3, 7, 4, "a chunked prefill's second chunk")
    s = st()
    generated(
        ctx,
        s.tuples(s.integers(1, 8), s.integers(0, 8)),
        lambda e: one(e[0], e[1] + e[0], e[1], "generated"),
    )


def check_sliding_window_mask(ns, ctx: Context) -> None:
    def one(seq, ctx_len, offset, window, label):
        where = f"{label}: " + case("sliding_window_mask", seq, ctx_len, offset=offset, window=window)
        q, k = _positions(seq, ctx_len, offset)
        mistakes = [
            (
                "the window's edge: a query at p sees p - window + 1 .. p, window keys with itself",
                lambda: _mask_from((k <= q) & (k >= q - window)),
            ),
            (
                "the offset ignored: row i sits at position offset + i",
                lambda: T.sliding_window_mask(seq, ctx_len, 0, window),
            ),
            ("the diagonal masked: a query sees its own key too", lambda: _mask_from((k < q) & (k > q - window))),
        ]
        got = ns.sliding_window_mask(seq, ctx_len, offset=offset, window=window)
        want = T.sliding_window_mask(seq, ctx_len, offset=offset, window=window)
        expect_array(where, got, want, atol=0, rtol=0, mistakes=mistakes)

    one(6, 6, 0, 3, "the window's edge, prefill of 6, window 3")
    one(1, 7, 6, 3, "a decode step at position 6, window 3")
    one(3, 9, 6, 2, "a chunked prefill, window 2")
    one(1, 1, 0, 1, "position 0, window 1")
    one(5, 5, 0, 4096, "a window wider than the context")
    s = st()
    generated(
        ctx,
        s.tuples(s.integers(1, 8), s.integers(0, 8), s.integers(1, 6)),
        lambda e: one(e[0], e[0] + e[1], e[1], e[2], "generated"),
    )


# --- softmax, norms, RoPE, SiLU ----------------------------------------------------------------------
def check_softmax(ns, ctx: Context) -> None:
    def one(x, axis, label):
        where = f"{label}: " + case("softmax", x, axis=axis)
        (arg,) = frozen(x)
        mistakes = [
            (
                "no maximum subtracted: exp(1e4) overflows to inf; subtract the max along the axis first",
                lambda: np.exp(x) / np.sum(np.exp(x), axis=axis, keepdims=True),
            ),
            (
                "normalized along the wrong axis: the sum must be 1 along `axis`",
                lambda: T.softmax(x, axis=0 if axis != 0 else -1),
            ),
        ]
        with np.errstate(over="ignore", invalid="ignore"):
            got = ns.softmax(arg, axis=axis)
        expect_array(where, got, T.softmax(x.copy(), axis=axis), atol=1e-7, rtol=1e-5, mistakes=mistakes)

    one(np.array([[1e4, 1e4 - 1.0, 0.0]], dtype=np.float32), -1, "logits of 1e4")
    one(np.array([[0.5, -np.inf, 2.0, -np.inf]], dtype=np.float32), -1, "masked scores (-inf)")
    one(np.array([[1.0, 2.0], [3.0, 5.0], [0.0, 0.0]], dtype=np.float32), 0, "along axis 0")
    s = st()

    def gen(e):
        dims, scale, seed = e
        x = (rng_for(ctx, seed).standard_normal(dims) * scale).astype(np.float32)
        one(x, -1, "generated")

    generated(
        ctx,
        s.tuples(
            s.lists(s.integers(1, 6), min_size=1, max_size=3), s.sampled_from([1.0, 10.0, 100.0]), s.integers(0, 999)
        ),
        gen,
    )


def check_rms_norm(ns, ctx: Context) -> None:
    def one(x, w, eps, label):
        where = f"{label}: " + case("rms_norm", x, w, eps)
        args = frozen(x, w)
        x64 = x.astype(np.float64)
        mistakes = [
            (
                "eps added after the square root: sqrt(mean(x^2) + eps), eps inside",
                lambda: x64 / (np.sqrt(np.mean(x64 * x64, -1, keepdims=True)) + eps) * w,
            ),
            (
                "the mean subtracted (that is LayerNorm): RMSNorm scales by the root mean square only",
                lambda: T.layer_norm(x, w, np.zeros_like(w), eps),
            ),
            (
                "no square root: divide by sqrt(mean(x^2) + eps)",
                lambda: x64 / (np.mean(x64 * x64, -1, keepdims=True) + eps) * w,
            ),
            ("the weight not applied: multiply by weight at the end", lambda: T.rms_norm(x, np.ones_like(w), eps)),
        ]
        expect_array(where, ns.rms_norm(*args, eps), T.rms_norm(x, w, eps), atol=1e-6, rtol=1e-5, mistakes=mistakes)

    r = rng_for(ctx, 1)
    one(np.zeros((2, 8), dtype=np.float32), np.ones(8, dtype=np.float32), 1e-5, "a row of zeros (eps keeps it finite)")
    one(
        r.standard_normal((3, 2, 4)).astype(np.float32),
        r.standard_normal(4).astype(np.float32),
        1e-6,
        "QK-norm: [heads, seq, head_dim]",
    )
    s = st()

    def gen(e):
        dims, seed = e
        g = rng_for(ctx, seed)
        x = g.standard_normal(dims).astype(np.float32)
        w = (1 + 0.1 * g.standard_normal(dims[-1])).astype(np.float32)
        one(x, w, 1e-5, "generated")

    generated(ctx, s.tuples(s.lists(s.integers(1, 6), min_size=1, max_size=3), s.integers(0, 999)), gen)


def _rotate_interleaved(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = -x[..., 1::2], x[..., 0::2]
    return out


def check_apply_rope(ns, ctx: Context) -> None:
    def one(heads, positions, head_dim, seed, label):
        g = rng_for(ctx, seed)
        x = g.standard_normal((heads, len(positions), head_dim)).astype(np.float32)
        cos, sin = T.rope_tables(np.asarray(positions), T.rope_inverse_frequencies(head_dim, 10000.0))
        where = f"{label}: " + case("apply_rope", x, cos, sin) + f" at positions {list(positions)}"
        xa, ca, sa = frozen(x, cos, sin)
        expect_array(
            f"{label}: " + case("rotate_half", x),
            ns.rotate_half(xa),
            T.rotate_half(x),
            atol=0,
            rtol=0,
            mistakes=[
                (
                    "rotate_half is [-x2, x1] (the second half negated, moved first)",
                    lambda: np.concatenate([x[..., head_dim // 2 :], -x[..., : head_dim // 2]], -1),
                ),
                (
                    "RoPE's halves paired as interleaved pairs: HF pairs j with j + head_dim/2, not 2j with 2j+1",
                    lambda: _rotate_interleaved(x),
                ),
            ],
        )
        mistakes = [
            (
                "RoPE's halves paired as interleaved pairs: HF pairs j with j + head_dim/2, not 2j with 2j+1",
                lambda: x * cos + _rotate_interleaved(x) * sin,
            ),
            ("the rotation's sign: x * cos + rotate_half(x) * sin", lambda: x * cos - T.rotate_half(x) * sin),
        ]
        expect_array(
            where, ns.apply_rope(xa, ca, sa), T.apply_rope(x, cos, sin), atol=1e-6, rtol=1e-5, mistakes=mistakes
        )

    one(2, [0], 8, 1, "position 0 (no rotation)")
    one(3, [5, 6, 7], 16, 2, "a chunk at positions 5-7")
    s = st()
    generated(
        ctx,
        s.tuples(
            s.integers(1, 4), s.integers(0, 40), s.integers(1, 5), s.sampled_from([2, 4, 8, 16]), s.integers(0, 999)
        ),
        lambda e: one(e[0], list(range(e[1], e[1] + e[2])), e[3], e[4], "generated"),
    )


def check_silu(ns, ctx: Context) -> None:
    def one(x, label):
        where = f"{label}: " + case("silu", x)
        x64 = x.astype(np.float64)
        mistakes = [
            ("that is sigmoid(x): SiLU is x * sigmoid(x)", lambda: 1 / (1 + np.exp(-x64))),
            ("that is x * tanh(x): SiLU is x * sigmoid(x)", lambda: x64 * np.tanh(x64)),
        ]
        with np.errstate(over="ignore"):
            got = ns.silu(*frozen(x))
        expect_array(where, got, T.silu(x), atol=1e-6, rtol=1e-5, mistakes=mistakes)

    one(np.array([-100.0, -1.0, 0.0, 1.0, 100.0], dtype=np.float32), "large and small inputs")
    s = st()
    generated(
        ctx,
        s.tuples(s.lists(s.integers(1, 6), min_size=1, max_size=2), s.integers(0, 999)),
        lambda e: one((rng_for(ctx, e[1]).standard_normal(e[0]) * 4).astype(np.float32), "generated"),
    )


# --- attention --------------------------------------------------------------------------------------
def _attention_tiled(q, k, v, mask, scale):
    group = q.shape[0] // k.shape[0]
    return T.attention(q, np.tile(k, (group, 1, 1)), np.tile(v, (group, 1, 1)), mask, scale)[0]


def check_attention(ns, ctx: Context) -> None:
    def one(n_kv, group, seq, past, head_dim, seed, label):
        g = rng_for(ctx, seed)
        n_heads, ctx_len = n_kv * group, past + seq
        q = g.standard_normal((n_heads, seq, head_dim)).astype(np.float32)
        k = g.standard_normal((n_kv, ctx_len, head_dim)).astype(np.float32)
        v = g.standard_normal((n_kv, ctx_len, head_dim)).astype(np.float32)
        mask, scale = T.causal_mask(seq, ctx_len, offset=past), head_dim**-0.5
        where = (
            f"{label}: " + case("attention", q, k, v, mask, scale) + f" ({n_heads} query heads over {n_kv} kv heads)"
        )
        want_z, want_p = T.attention(q, k, v, mask.copy(), scale)
        mistakes = [
            (
                "heads repeated in the wrong order: query head h reads kv head h // group (np.repeat, not np.tile)",
                lambda: _attention_tiled(q, k, v, mask, scale),
            ),
            ("the scale: multiply q . k by scale (head_dim ** -0.5), once", lambda: T.attention(q, k, v, mask, 1.0)[0]),
            (
                "the mask ignored: add it to the scores before the softmax",
                lambda: T.attention(q, k, v, np.zeros_like(mask), scale)[0],
            ),
        ]
        with np.errstate(over="ignore", invalid="ignore"):
            result = ns.attention(*frozen(q, k, v, mask), scale)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise Failed(where, f"returned a {type(result).__name__}, expected a tuple (z, pattern)")
        z, pattern = result
        expect_array(where, z, want_z, atol=1e-5, rtol=1e-4, mistakes=mistakes, what="z")
        expect_array(where, pattern, want_p, atol=1e-6, rtol=1e-4, what="the pattern")

    one(2, 3, 4, 0, 8, 1, "GQA prefill: 6 query heads over 2 kv heads")
    one(2, 2, 1, 5, 4, 2, "a decode step over 5 cached positions")
    one(1, 1, 3, 4, 4, 3, "a chunked prefill")
    s = st()
    generated(
        ctx,
        s.tuples(
            s.integers(1, 3),
            s.integers(1, 3),
            s.integers(1, 5),
            s.integers(0, 4),
            s.sampled_from([2, 4, 8]),
            s.integers(0, 999),
        ),
        lambda e: one(*e, "generated"),
    )
