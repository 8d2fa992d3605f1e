"""The faster paths of issue 16's speed work compute what the plain paths compute.

- ``kernels/products.py``: every few-rows formulation against NumPy's float64 product (a reference
  computed outside minillm's code paths), for the model's own shapes and 1 to 64 rows; the plan
  per BLAS kernel against the table written by hand from the measurements in the module docstring.
- ``kernels.attention.attention_in_chunks`` (prefill over more than 128 positions) against the one-call
  ``primitives.attention`` and against a float64 softmax attention written out here; a 300-token
  SmolLM2 prefill (every row, so the chunked path runs in every layer) against transformers, with
  the prefill's gate_up product plain and as ``products.left`` (``products.PREFILL_LEFT``).
- ``sampling.top_candidates`` (one partition, then a sort of the few) against the full stable sort
  of the whole distribution, the definition it replaced, ties and zeros included.
"""

from __future__ import annotations

import numpy as np
import pytest

import minillm
from minillm.kernels import products
from minillm.kernels.attention import ATTENTION_CHUNK, attention_in_chunks
from minillm.kernels.tuned import TUNED
from minillm.model import primitives
from minillm.runtime.sampling import top_candidates

# SmolLM2-135M's matrices ([out, in]): q|k|v fused, o, gate|up fused, down, and a slice of the LM
# head's shape (rows not a multiple of a slice, so the last slice is short).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (5000, 576)]


@pytest.mark.parametrize("name", sorted(products.FORMULATIONS))
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 33, 64])
def test_every_formulation_is_the_product(name, rows):
    rng = np.random.default_rng(rows)
    for out_dim, in_dim in SHAPES:
        w = rng.standard_normal((out_dim, in_dim), dtype=np.float32) / np.float32(np.sqrt(in_dim))
        x = rng.standard_normal((rows, in_dim), dtype=np.float32)
        got = products.FORMULATIONS[name](x, w)
        want = x.astype(np.float64) @ w.astype(np.float64).T  # the reference: float64, NumPy
        assert got.shape == (rows, out_dim) and got.dtype == np.float32
        # one memory order or the other (``left`` gives its [out, rows] product's transposed view)
        assert got.flags.c_contiguous or (name == "left" and got.flags.f_contiguous)
        # float32 sums of 576..1536 terms of size ~1: rounding well under 1e-4
        assert np.abs(got - want).max() < 1e-4, (name, rows, out_dim, in_dim)


def test_the_plan_per_kernel_and_threads_is_the_measured_table():
    # Written by hand from the table in products.py's docstring (SmolLM2's products, 1 and 2 threads).
    expected = {
        ("SkylakeX", 1): {1: "plain", 2: "sliced", 8: "sliced", 9: "left", 32: "left", 64: "left", 65: "plain"},
        ("SkylakeX", 2): {1: "plain", 2: "sliced", 4: "sliced", 5: "left", 8: "left", 64: "left", 65: "plain"},
        ("SkylakeX", 8): {4: "sliced", 5: "left"},  # more threads than measured: the most measured
        ("Haswell", 1): {1: "plain", 2: "sliced_gemv", 3: "sliced_gemv", 4: "left", 64: "left", 65: "plain"},
        ("Haswell", 2): {2: "sliced_gemv", 3: "plain", 8: "plain", 64: "plain"},
        ("Zen", 1): {2: "plain", 8: "plain"},  # a kernel never measured keeps NumPy's own product
        ("", 2): {2: "plain"},  # no OpenBLAS (threadpoolctl reports no architecture)
    }
    for (kernel, threads), by_rows in expected.items():
        got = {rows: products.formulation(rows, kernel, threads) for rows in by_rows}
        assert got == by_rows, (kernel, threads)
    # This process's kernel and thread count are the ones threadpoolctl reports; the thread count
    # is read at each product, so threadpool_limits changes the plan.
    from threadpoolctl import threadpool_info, threadpool_limits

    blas = [lib for lib in threadpool_info() if lib["user_api"] == "blas"]
    assert products.blas_kernel() == str(blas[0].get("architecture") or "")
    for threads in (1, 2):
        with threadpool_limits(threads, "blas"):
            assert products.blas_threads() == threads
            assert products.formulation(8) == products.formulation(8, products.blas_kernel(), threads)


def test_linear_takes_the_plan_only_inside_a_batched_pass(monkeypatch):
    seen = []
    monkeypatch.setattr(products, "few_rows_product", lambda x, w: seen.append(x.shape[0]) or x @ w.T)
    x, w = np.ones((8, 4), np.float32), np.ones((3, 4), np.float32)
    TUNED.linear(x, w)  # one sequence's forward: the plain product, as lesson 1 measured
    TUNED.linear(x, w, batched=True)  # 8 rows in a batched pass: the plan
    TUNED.linear(x[:1], w, batched=True)  # one row: a matrix-vector product either way
    TUNED.linear(np.ones((65, 4), np.float32), w, batched=True)  # more than FEW_ROWS: the plain product
    TUNED.linear(x, (w, w), batched=True)  # a memory-mapped projection's parts: each by the plan
    assert seen == [8, 8, 8]


def _reference_attention(q, k, v, mask, scale):
    """Softmax attention in float64, written out (GQA: query head h reads kv head h // group)."""
    n_heads, n_kv = q.shape[0], k.shape[0]
    group = n_heads // n_kv
    z = np.empty(q.shape, dtype=np.float64)
    for h in range(n_heads):
        s = (q[h].astype(np.float64) * scale) @ k[h // group].astype(np.float64).T + mask
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        z[h] = (p / p.sum(axis=-1, keepdims=True)) @ v[h // group]
    return z


@pytest.mark.parametrize("seq, offset, window", [(300, 0, None), (129, 40, None), (260, 17, 100), (128, 0, None)])
def test_attention_in_chunks_is_attention(seq, offset, window):
    rng = np.random.default_rng(seq)
    n_heads, n_kv, hd, ctx = 9, 3, 64, offset + seq
    q = rng.standard_normal((n_heads, seq, hd), dtype=np.float32)
    k = rng.standard_normal((n_kv, ctx, hd), dtype=np.float32)
    v = rng.standard_normal((n_kv, ctx, hd), dtype=np.float32)
    if window is None:
        mask = primitives.causal_mask(seq, ctx, offset=offset)
    else:
        mask = primitives.sliding_window_mask(seq, ctx, offset=offset, window=window)
    chunked = attention_in_chunks(q, k, v, mask, hd**-0.5)
    whole, _ = primitives.attention(q, k, v, mask, hd**-0.5)
    assert np.abs(chunked - whole).max() < 1e-5  # float32 rounding: fewer zero terms in the sums
    assert np.abs(chunked - _reference_attention(q, k, v, mask, hd**-0.5)).max() < 1e-5


def test_prefill_takes_left_for_gate_up_under_skylakex_only():
    # Written by hand from PREFILL_LEFT's measurements: SkylakeX's prefill gate_up; nothing else.
    form = products.prefill_formulation
    assert form("gate_up", 512, "SkylakeX") == form("gate_up", 65, "SkylakeX") == "left"
    assert form("gate_up", 64, "SkylakeX") == "plain"  # few rows: linear's own plan
    assert {form(name, 512, "SkylakeX") for name in ("qkv", "o", "down", "up")} == {"plain"}
    assert {form("gate_up", 512, kernel) for kernel in ("Haswell", "Zen", "")} == {"plain"}


@pytest.mark.slow
@pytest.mark.parametrize("gate_up", ["as planned", "left"])
def test_a_long_prefill_through_chunked_attention_matches_transformers(smollm2, hf_smollm2, gate_up, monkeypatch):
    """Every row of a 300-token prefill against transformers; ``left``: the gate_up product as
    ``products.left`` under this process's kernel too (SkylakeX's prefill formulation, checked here
    whatever kernel CI runs)."""
    import torch

    if gate_up == "left":
        monkeypatch.setitem(products.PREFILL_LEFT, products.blas_kernel(), frozenset({"gate_up"}))
        assert products.prefill_formulation("gate_up", 300) == "left"
    ids = np.random.default_rng(3).integers(0, smollm2.config.vocab_size, 300)
    assert len(ids) > 2 * ATTENTION_CHUNK  # three chunks in every layer: 128, 128, 44
    cache = minillm.KVCache.for_model(smollm2.config, max_seq_len=300)
    ours = smollm2.transformer.forward(ids, cache)  # [300, vocab], every row
    with torch.no_grad():
        theirs = hf_smollm2(torch.tensor([ids.tolist()])).logits[0].numpy()  # the reference
    # Every row: float32 rounding over 300 x 49,152 logits (the largest |logit| 34.7) reaches 7.4e-5
    # under OpenBLAS's Haswell kernel and 1.2e-4 under SkylakeX's, the same with one-call attention
    # (the short prompts' parity tests, on the last row, keep 1e-4).
    assert np.abs(ours - theirs).max() < 2e-4


def _full_sort_top(probs, k):
    """The definition: every id with probability > 0, stably sorted by probability, first k."""
    kept = np.flatnonzero(probs > 0)
    top = kept[np.argsort(-probs[kept], kind="stable")[:k]]
    return [(int(i), float(probs[i])) for i in top]


def test_top_candidates_is_the_full_stable_sort():
    rng = np.random.default_rng(0)
    cases = [rng.dirichlet(np.ones(49152)).astype(np.float32) for _ in range(3)]
    tied = np.zeros(100, np.float32)
    tied[[3, 7, 11, 50, 60, 99]] = [0.1, 0.3, 0.1, 0.1, 0.3, 0.1]  # ties at the 5th place: lower ids first
    cases += [tied, np.array([0.0, 0.5, 0.0, 0.5], np.float32), np.array([1.0], np.float32)]
    for probs in cases:
        for k in (1, 5):
            assert top_candidates(probs, k) == _full_sort_top(probs, k)
    # worked by hand: ids 7 and 60 at 0.3, then the four ties at 0.1 in id order: 3, 11, 50 (k=5)
    assert [i for i, _ in top_candidates(tied, 5)] == [7, 60, 3, 11, 50]
