"""Unit cases of the units that hold state or addresses: the KV cache (``model/kv_cache.py``), the
streaming detokenizer (``text/detokenize.py``) and the paged pool's address math
(``model/paged_kv_cache.py``); ``cases.py`` says how every check works."""

from __future__ import annotations

import numpy as np

from minillm.exercises.compare import Failed, case, expect_array, expect_equal, frozen
from minillm.exercises.generated import Context, generated, rng_for, st
from minillm.model import paged_kv_cache as paged
from minillm.model.kv_cache import KVCache as TextbookKVCache
from minillm.text.detokenize import IncrementalDetokenizer

# --- the KV cache -------------------------------------------------------------------------------------
KV_SHAPE = (2, 2, 4, 16)  # layers, kv heads, head_dim, max_seq_len


def _same_pair(where: str, got, want, what: str, mistakes=()) -> None:
    """``got`` is a (keys, values) pair equal to ``want``'s, element for element."""
    if not (isinstance(got, tuple) and len(got) == 2):
        raise Failed(where, f"{what} returned a {type(got).__name__}, expected a tuple (keys, values)")
    expect_array(
        where, np.asarray(got[0]), want[0], atol=0, rtol=0, what=f"the keys {what} returned", mistakes=mistakes
    )
    expect_array(where, np.asarray(got[1]), want[1], atol=0, rtol=0, what=f"the values {what} returned")


def _cache_step(mine, ref, op: str, n: int, g: np.random.Generator, here: str) -> None:
    """One step on both caches: ``truncate(n)``, or ``write`` of ``n`` positions on every layer then
    ``advance(n)``; each result compared."""
    if op == "truncate":
        ref.truncate(n)
        mine.truncate(n)
        return
    before = int(mine.length)
    for layer in range(ref.num_layers):
        k, v = (g.standard_normal((ref.num_kv_heads, n, ref.head_dim)).astype(np.float32) for _ in range(2))
        hint = ("write returns every filled position 0..length+seq-1, not this call's only", lambda k=k: k)
        _same_pair(f"{here} layer {layer}", mine.write(layer, *frozen(k, v)), ref.write(layer, k, v), "write", [hint])
    ref.advance(n)
    mine.advance(n)
    if int(mine.length) != ref.length:
        stuck = "a cache that does not advance: advance(seq) moves length on by seq"
        message = f"length is {mine.length!r} after advance({n}), expected {ref.length}"
        raise Failed(here, message, stuck if int(mine.length) == before else None)


def _cache_script(ns, ctx: Context, steps: list[tuple[str, int]], seed: int, label: str) -> None:
    """A new cache of :data:`KV_SHAPE`, then ``steps``; length and every layer's ``read`` compared after each."""
    g = rng_for(ctx, seed)
    where = f"{label}: KVCache{KV_SHAPE} then " + ", ".join(f"{op}({n})" for op, n in steps)
    mine, ref = ns.KVCache(*KV_SHAPE), TextbookKVCache(*KV_SHAPE)
    expect_equal(where + " [a new cache]", mine.length, 0, what="length")
    for step, (op, n) in enumerate(steps):
        here = f"{where} [step {step + 1}: {op}({n})]"
        _cache_step(mine, ref, op, n, g, here)
        expect_equal(here, int(mine.length), ref.length, what="length")
        for layer in range(ref.num_layers):
            _same_pair(
                f"{here} read({layer}, {ref.length})", mine.read(layer, ref.length), ref.read(layer, ref.length), "read"
            )


def check_KVCache(ns, ctx: Context) -> None:  # noqa: N802 (the unit's own name)
    _cache_script(ns, ctx, [], 1, "an empty cache")
    _cache_script(ns, ctx, [("write", 4), ("write", 1), ("write", 1)], 2, "prefill of 4, then two decode steps")
    _cache_script(ns, ctx, [("write", 5), ("truncate", 2), ("write", 1)], 3, "a truncate to 2, then a write at 2")
    _cache_script(ns, ctx, [("write", 3), ("truncate", 0), ("write", 2)], 4, "a truncate to 0")
    s = st()

    def gen(e):
        ops, seed = e
        steps, length = [], 0
        for n, cut in ops:
            if cut and length:
                length = n % (length + 1)
                steps.append(("truncate", length))
            elif length + n <= KV_SHAPE[3]:
                steps.append(("write", n))
                length += n
        _cache_script(ns, ctx, steps, seed, "generated")

    generated(ctx, s.tuples(s.lists(s.tuples(s.integers(1, 5), s.booleans()), max_size=6), s.integers(0, 999)), gen)


# --- streaming text -----------------------------------------------------------------------------------
#: Texts whose tokens split words, spaces and UTF-8 characters: '很' and '😀' are several byte tokens.
DETOKENIZER_TEXTS = (
    "The capital of France is Paris.",
    "很好，谢谢。",
    "x² + y³ = ½ 😀 café",
)


def _streams(tokenizer) -> list[tuple[str, list[int]]]:
    """Each text's ids, and the first of them cut inside a character: a stream that ends on half a
    character (``max_tokens`` cut it), whose full decode ends in U+FFFD."""
    streams = [(text, [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]) for text in DETOKENIZER_TEXTS]
    for text, ids in streams[1:]:
        cut = next((n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd")), None)
        if cut is not None:
            return [*streams, (f"{text} cut after {cut} ids, inside a character", ids[:cut])]
    return streams


def check_IncrementalDetokenizer(ns, ctx: Context) -> None:  # noqa: N802 (the unit's own name)
    tokenizer = ctx.tokenizer()
    for text, ids in _streams(tokenizer):
        where = f"the ids of {text!r} ({len(ids)} tokens), added one at a time"
        mine, ref = ns.IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer)
        shown_mine, shown_ref = "", ""
        alone = [tokenizer.decode([i]) for i in ids]
        for n, token_id in enumerate(ids):
            shown_ref += ref.add(token_id)
            delta = mine.add(token_id)
            if not isinstance(delta, str):
                raise Failed(where, f"add returned a {type(delta).__name__}, expected the text (str) it completes")
            shown_mine += delta
            if shown_mine != shown_ref:
                hint = None
                if shown_mine.endswith("\ufffd"):
                    hint = "a token that ends inside a UTF-8 character: hold it back until the character is complete"
                elif shown_mine == "".join(alone[: n + 1]):
                    hint = "each id decoded alone: decode it with the ids before it as context; emit the new text only"
                raise Failed(
                    f"{where} [after id {n + 1}: {token_id}]",
                    f"the text shown so far is {shown_mine!r}, the textbook shows {shown_ref!r}",
                    hint,
                )
        shown_mine += mine.flush()
        expect_equal(where + " [then flush()]", shown_mine, tokenizer.decode(ids), what="the whole stream")


# --- the paged pool's addresses -------------------------------------------------------------------------
def check_blocks_for(ns, ctx: Context) -> None:
    def one(positions, block_size, label):
        mistakes = [
            (
                "a partly filled block is a block too: ceil(positions / block_size), not floor",
                lambda: positions // block_size,
            )
        ]
        expect_equal(
            f"{label}: " + case("blocks_for", positions, block_size),
            ns.blocks_for(positions, block_size),
            paged.blocks_for(positions, block_size),
            mistakes=mistakes,
        )

    for positions, label in (
        (0, "no positions"),
        (16, "exactly one block"),
        (17, "one past a block"),
        (1, "one position"),
    ):
        one(positions, 16, label)
    s = st()
    generated(ctx, s.tuples(s.integers(0, 500), s.integers(1, 64)), lambda e: one(e[0], e[1], "generated"))


def check_slots(ns, ctx: Context) -> None:
    def one(table, positions, block_size, label):
        where = f"{label}: " + case("slots", table, positions, block_size)
        want = paged.slots(table, positions, block_size)
        mistakes = [
            ("look the block up in the table: table[p // block_size], not block p // block_size", lambda: positions),
            (
                "the slot is block * block_size + p % block_size",
                lambda: paged.slots(table, positions, block_size) - positions % block_size,
            ),
        ]
        got = ns.slots(*frozen(table, positions), block_size)
        expect_array(
            where,
            np.asarray(got).astype(np.int64) if isinstance(got, np.ndarray) else got,
            want,
            atol=0,
            rtol=0,
            mistakes=mistakes,
        )

    one(np.array([7, 2, 5]), np.arange(0, 40, 3), 16, "one sequence's table")
    one(np.array([[4, 1], [0, 3]]), np.array([17, 5]), 16, "a table per row (a batch's decode step)")
    s = st()

    def gen(e):
        n_blocks, bs, seed = e
        g = rng_for(ctx, seed)
        table = g.permutation(4 * n_blocks)[:n_blocks]
        one(table, np.sort(g.integers(0, n_blocks * bs, size=5)), bs, "generated")

    generated(ctx, s.tuples(s.integers(1, 6), s.sampled_from([1, 4, 16]), s.integers(0, 999)), gen)


def check_block_hashes(ns, ctx: Context) -> None:
    def one(ids, bs, identity, label):
        where = f"{label}: " + case("block_hashes", ids, bs, identity=identity)
        want = paged.block_hashes(ids, bs, identity=identity)
        mistakes = [
            (
                "chain the hashes: block j's hash covers h_{j-1} (prompts share block j only if they share 0..j)",
                lambda: [
                    paged.block_hashes(ids[j * bs : (j + 1) * bs], bs, identity=identity)[0]
                    for j in range(len(ids) // bs)
                ],
            ),
            (
                "only full blocks are hashed: a partly filled last block has no hash",
                lambda: paged.block_hashes(list(ids) + [0] * (-len(ids) % bs), bs, identity=identity),
            ),
        ]
        got = ns.block_hashes(list(ids), bs, identity=identity)
        expect_equal(
            where, list(got) if isinstance(got, (list, tuple)) else got, want, mistakes=mistakes, what="the hashes"
        )

    one(list(range(10)), 4, b"", "two full blocks and a partial one")
    one([5, 6, 7, 8], 4, b"adapter-a", "an identity")
    one([1, 2, 3], 4, b"", "no full block")
    s = st()
    generated(
        ctx,
        s.tuples(s.lists(s.integers(0, 50000), max_size=40), s.sampled_from([1, 4, 16])),
        lambda e: one(e[0], e[1], b"", "generated"),
    )
