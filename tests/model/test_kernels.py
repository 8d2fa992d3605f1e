"""The textbook and the engine room compute the same forward: ``Kernels`` (minillm/model/kernels.py)
against ``TunedKernels`` (minillm/kernels/tuned.py).

Plain and tuned share one set of weights (two ``Transformer`` objects over the same arrays), so any
difference is the kernels' float32 rounding: logits within 1e-4 (TOLERANCE) for SmolLM2 prefills of 1 to 600
tokens (600: attention in causal chunks in every layer) and batched decode steps of 1, 8 and 32
rows through the paged pool (the tuned path gathers them together), and equal greedy ids over 32
tokens for 5 prompts, alone and batched. The seam's fast facts (which form is taken when, the
load option's errors, the trace's row) need no model. Gemma 3: ``test_kernels_gemma3.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from helpers import batched_decode_logits

import minillm
from minillm.errors import InvalidRequestError
from minillm.kernels import products
from minillm.kernels.tuned import TUNED, TunedKernels
from minillm.model.held import BFloat16Matrix, Float32Matrix, Int8Matrix, StackedMatrix
from minillm.model.kernels import PLAIN, Kernels
from minillm.model.paged_kv_cache import KVCachePool
from minillm.model.transformer import Transformer

#: Plain vs tuned on SmolLM2 (logits up to ~35 in size), measured: batched decode 1.3e-5 to 5.9e-5,
#: a 600-token prefill 6.3e-5 (attention in causal chunks), from float32 sums in another order
#: through 30 layers; the tiny Llama's small logits stay within 1e-5. 1e-4: the parity tests' bar.
TOLERANCE = 1e-4

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Water boils at",
    "List three primary colors:",
]


# --- the seam, no model -----------------------------------------------------------------------------
def test_load_refuses_an_unknown_kernels_choice_naming_both():
    with pytest.raises(InvalidRequestError, match=r"kernels must be 'tuned' .* or 'plain' .*got 'fast'"):
        minillm.load("smollm2-135m-instruct", kernels="fast", progress=False)


def test_plain_linear_is_x_w_t_for_every_holder():
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s, dtype=np.float32) for s in ((5, 8), (6, 8), (6,)))
    assert np.array_equal(PLAIN.linear(x, Float32Matrix(w), b), x @ w.T + b)  # the page's x @ w.T, bit for bit
    stacked = StackedMatrix([Float32Matrix(w[:2]), Float32Matrix(w[2:])])  # a memory-mapped projection's parts
    parts = PLAIN.linear(x, stacked)
    assert parts.shape == (5, 6) and np.array_equal(parts, np.concatenate([x @ w[:2].T, x @ w[2:].T], axis=-1))
    for held in (Int8Matrix(w), BFloat16Matrix(w)):  # compact formats: x @ (their float32 rows).T
        np.testing.assert_allclose(PLAIN.linear(x, held), x @ held.to_float32().T, rtol=1e-5, atol=1e-5)
    assert Float32Matrix(w).dense is w and Int8Matrix(w).dense is None and stacked.dense is None


def test_tuned_prepares_left_for_the_prefill_matrices_the_plan_names(monkeypatch):
    """The tuned kernels decide per matrix at load (``prepare``): a prefill of a layer's ``w_gate_up``
    takes ``left`` where ``PREFILL_LEFT`` lists it; per call only the matrix crosses, never a name."""
    seen = []
    monkeypatch.setitem(products.PREFILL_LEFT, products.blas_kernel(), frozenset({"gate_up"}))
    monkeypatch.setattr(products, "left", lambda x, w: seen.append(x.shape[0]) or (w @ x.T).T)
    x = np.ones((65, 4), np.float32)
    gate_up, down = (Float32Matrix(np.ones((3, 4), np.float32)) for _ in range(2))
    weights = SimpleNamespace(layers=[SimpleNamespace(w_gate_up=gate_up, w_down=down)])
    tuned = TUNED.prepare(weights)
    assert isinstance(tuned, TunedKernels) and list(tuned.left_in_prefill) == [id(gate_up)]
    tuned.linear(x, gate_up)  # a prefill of the chosen matrix: left
    tuned.linear(x, down)  # not chosen: plain
    tuned.linear(x[:64], gate_up)  # 64 rows are few: never left
    TUNED.linear(x, gate_up)  # the shared, unprepared kernels chose nothing
    assert PLAIN.prepare(weights) is PLAIN  # the textbook chooses nothing
    PLAIN.linear(x, gate_up)
    assert seen == [65]


def test_the_tuned_kernels_are_the_plain_ones_overridden():
    assert isinstance(TUNED, Kernels) and isinstance(TUNED, TunedKernels)
    names = (PLAIN.name, PLAIN.source, TUNED.name, TUNED.source)
    assert names == ("plain", "minillm/model", "tuned", "minillm/kernels")
    assert {"prepare", "begin", "linear", "attention"} <= set(vars(TunedKernels))


def test_a_tiny_model_plain_and_tuned_batches_agree(tiny_llama):
    """Three decode rows of one pool and a 3-token prefill chunk in one batch, on the tiny Llama: the
    tuned path (the rows gathered together) within 1e-5 of the plain one (each sequence alone)."""
    _, plain = tiny_llama
    tuned = Transformer(plain.config, plain.weights, TUNED)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, plain.config.vocab_size, n) for n in (5, 9, 13, 3)]
    got = {}
    for name, model in (("plain", plain), ("tuned", tuned)):
        pool = KVCachePool.for_model(plain.config, kv_cache_mib=1.0, block_size=4)
        seqs = [pool.sequence(60) for _ in prompts]
        for seq, ids in zip(seqs, prompts, strict=True):
            pool.grow(seq, len(ids))
        for seq, ids in zip(seqs[:3], prompts[:3], strict=True):
            model.forward(ids[:-1], seq)  # the last id comes as a decode row
        chunks = [(p[-1:], s) for p, s in zip(prompts[:3], seqs[:3], strict=True)] + [(prompts[3], seqs[3])]
        got[name] = model.forward_batch(chunks, all_logits=True)  # [3 + 3, vocab]
    assert got["plain"].shape == (6, plain.config.vocab_size)
    assert np.abs(got["plain"] - got["tuned"]).max() < 1e-5


def test_the_pools_address_math_slots_tables_and_gather():
    """The slot formula, the padded block tables and the gather the grouped decode rows use
    (``KVCachePool``: all of the pool's address math), on the module docstring's table [7, 2, 9]."""
    pool = KVCachePool(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=10, block_size=4)
    assert pool.slots(np.array([7, 2, 9]), np.arange(10)).tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]
    assert pool.slots(np.array([[7, 2], [3, 0]]), np.array([5, 2])).tolist() == [9, 14]  # one position a row
    a, b = pool.sequence(12), pool.sequence(12)
    a.block_table, b.block_table = [7, 2, 9], [3]
    tables = pool.padded_tables([a, b], np.array([10, 2]))
    assert tables.tolist() == [[7, 2, 9], [3, 0, 0]]  # padding: block 0
    k = np.arange(20, dtype=np.float32).reshape(1, 10, 2)  # [kv_heads, 10 positions, head_dim]
    pool.write_slots(0, pool.slots(np.array([7, 2, 9]), np.arange(10)), k, -k)
    keys, values = pool.gather(0, tables)  # [2 rows, kv_heads, 3 blocks * 4, head_dim]
    assert keys.shape == (2, 1, 12, 2)
    assert np.array_equal(keys[0, :, :10], k) and np.array_equal(values[0, :, :10], -k)  # in position order


# --- SmolLM2 ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def both(smollm2):
    """The session's SmolLM2 (tuned, minillm.load's default) and a plain Transformer on its weights."""
    assert isinstance(smollm2.transformer.kernels, TunedKernels)  # TUNED, prepared for its weights
    return {"plain": Transformer(smollm2.config, smollm2.transformer.weights, PLAIN), "tuned": smollm2.transformer}


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 2, 5, 64, 129, 600])
def test_prefill_logits_plain_equal_tuned(both, tokens):
    ids = np.random.default_rng(tokens).integers(0, 49152, tokens)
    logits = {}
    for name, model in both.items():
        cache = minillm.KVCache.for_model(model.config, max_seq_len=tokens)
        logits[name] = model.forward(ids, cache)  # [tokens, vocab]: every row
    assert logits["plain"].shape == (tokens, 49152)
    assert np.abs(logits["plain"] - logits["tuned"]).max() < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_batched_decode_logits_plain_equal_tuned(both, batch):
    plain, tuned = (batched_decode_logits(both[name], batch) for name in ("plain", "tuned"))
    assert plain.shape == (2, batch, 49152)
    assert np.abs(plain - tuned).max() < TOLERANCE


def _greedy(model, ids: np.ndarray, n: int) -> list[int]:
    cache = minillm.KVCache.for_model(model.config, max_seq_len=len(ids) + n)
    logits = model.forward(ids, cache, last_only=True)[0]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.forward(np.array([out[-1]]), cache)[0]
    return out


def _greedy_batched(model, prompts: list[np.ndarray], n: int) -> list[list[int]]:
    """The prompts prefilled, then ``n`` greedy tokens for all of them in one batched step each."""
    cfg = model.config
    pool = KVCachePool.for_model(cfg, kv_cache_mib=len(prompts) * 6 * 16 * cfg.kv_bytes_per_token() / 2**20)
    seqs = [pool.sequence(len(p) + n) for p in prompts]
    last = []
    for p, seq in zip(prompts, seqs, strict=True):
        pool.grow(seq, len(p))
        last.append(int(np.argmax(model.forward(p, seq, last_only=True)[0])))
    out = [[t] for t in last]
    for _ in range(n - 1):
        for seq in seqs:
            pool.grow(seq, 1)
        logits = model.forward_batch([(np.array([o[-1]]), s) for o, s in zip(out, seqs, strict=True)])
        for o, t in zip(out, np.argmax(logits, axis=-1), strict=True):
            o.append(int(t))
    return out


@pytest.mark.slow
def test_greedy_ids_plain_equal_tuned_alone_and_batched(smollm2, both):
    prompts = [minillm.tokenize(smollm2, p) for p in PROMPTS]
    alone = {name: [_greedy(model, p, 32) for p in prompts] for name, model in both.items()}
    assert alone["plain"] == alone["tuned"]
    assert alone["tuned"][0][0] == 7042  # " Paris" after "The capital of France is"
    batched = {name: _greedy_batched(model, prompts, 32) for name, model in both.items()}
    assert batched["plain"] == batched["tuned"] == alone["tuned"]


@pytest.mark.slow
def test_the_trace_names_the_kernels(smollm2):
    from minillm.observe import describe

    assert describe.load(smollm2, {})["kernels"] == {"name": "tuned", "source": "minillm/kernels"}
