"""Speculative decoding (minillm/runtime/speculative.py, drafts.py): the target's distribution kept exactly.

Where expected values come from: greedy ids from plain decoding (the same model, no draft); the
sampled distribution in closed form from the acceptance rule's pieces (sum over accept / reject
paths) and, through ``generate`` on a tiny random model, from the plain sampler's own
probabilities (``sampling.process_logits`` + softmax) over every 3-token continuation; rollback
against a cache that never saw the rejected tokens; block counts worked out by hand.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
from scripted import word_tokenizer_folder

import minillm
from minillm.errors import InvalidRequestError
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import KVCache
from minillm.model.paged_kv_cache import KVCachePool
from minillm.model.transformer import Transformer
from minillm.model.weights import load_weights
from minillm.runtime import sampling
from minillm.runtime.drafts import Draft, NgramDraft
from minillm.runtime.loading import Model
from minillm.runtime.speculative import (
    Speculative,
    acceptance_probability,
    distribution,
    expected_tokens_per_pass,
    next_k,
    per_position_acceptance,
    residual,
    verify,
)
from minillm.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["AB C DEF AB C", "G HI J KL G HI", "X Y Z X Y Z X", "DE w DE w DE", "C C C AB DEF G"]


@pytest.fixture(scope="module")
def word_model(tmp_path_factory) -> Model:
    """A tiny random Llama (4 layers, seeded) over the scripted word vocabulary (108 ids)."""
    import torch
    import transformers

    folder = word_tokenizer_folder(tmp_path_factory.mktemp("spec-model"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=108, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the random init's, so greedy and top-k mean something
        hf.lm_head.weight.mul_(40.0)
    hf.save_pretrained(folder)
    config = ModelConfig.from_folder(folder)
    transformer = Transformer(config, load_weights(folder, config))
    return Model("word", folder, config, Tokenizer.from_folder(folder), transformer, None)


# --- the acceptance rule, in closed form -----------------------------------------------------------
def first_token_distribution(p: np.ndarray, q: np.ndarray | None) -> np.ndarray:
    """Exact distribution of the token emitted at a verified position: draft x ~ q (one-hot x for a
    deterministic draft, averaged over x ~ p's support to cover every x), kept with the acceptance
    probability, else drawn from the residual."""
    out = np.zeros_like(p)
    for x in range(len(p)):
        qx = q[x] if q is not None else 1.0
        if qx == 0:
            continue
        a = acceptance_probability(p, q, x)
        out[x] += qx * a
        out += qx * (1 - a) * residual(p, q, x)
    return out


@pytest.mark.parametrize("vocab", [2, 5, 12])
def test_acceptance_rule_keeps_p_exactly(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(50):
        p = rng.dirichlet(np.ones(vocab) * 0.5)
        q = rng.dirichlet(np.ones(vocab) * 0.5)
        q[rng.integers(vocab)] = 0.0  # the draft rules out an id the model allows
        q /= q.sum()
        np.testing.assert_allclose(first_token_distribution(p, q), p, atol=1e-12)
        for x in range(vocab):  # a deterministic draft proposing x: p(x) kept, the rest from p without x
            one_hot = np.eye(vocab)[x]
            exact = p[x] * one_hot + (1 - p[x]) * residual(p, None, x)
            np.testing.assert_allclose(exact, p, atol=1e-12)
    same = rng.dirichlet(np.ones(vocab))
    assert acceptance_probability(same, same, 0) == 1.0  # a draft equal to the model is always kept


def test_verify_monte_carlo_matches_p_at_every_position():
    """The real ``verify`` over k = 3 drafts drawn from q: the first emitted token is p_0-distributed,
    and the whole emitted run follows p (second token checked given the first kept draft)."""
    rng = np.random.default_rng(7)
    vocab, k, n = 4, 3, 40_000
    p = rng.dirichlet(np.ones(vocab), size=k + 1)
    q = rng.dirichlet(np.ones(vocab), size=k)
    first = np.zeros(vocab)
    for _ in range(n):
        drafted = [int(rng.choice(vocab, p=q[i])) for i in range(k)]
        accepted, token = verify(lambda i: p[i], q, drafted, rng)
        first[drafted[0] if accepted else token] += 1
    # 4 cells, 3 degrees of freedom: chi-square above 30 has probability < 1e-6 under p
    assert chi_square(first, p[0] * n) < 30


def chi_square(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


# --- through generate: greedy equality, the sampled distribution -------------------------------------
DRAFTS = ["ngram", "layers:1", "layers:3", "self-int8"]


@pytest.mark.parametrize("draft", DRAFTS)
def test_greedy_speculative_equals_plain_on_five_prompts(word_model, draft):
    for prompt in PROMPTS:
        plain = minillm.generate(word_model, prompt, max_new_tokens=20)
        for k in (1, 4, 8):
            spec = minillm.generate(word_model, prompt, max_new_tokens=20, speculative=Speculative(draft, num_tokens=k))
            assert spec.ids == plain.ids, (prompt, k)
            assert spec.text == plain.text and spec.stop_reason == plain.stop_reason
            m = spec.metrics
            assert m.target_passes + m.accepted_tokens == len(spec.ids)  # each pass: its accepted + 1
            assert m.accepted_tokens <= m.drafted_tokens


def test_greedy_with_repetition_penalty_and_batch(word_model):
    params = minillm.SamplingParams(temperature=0.0, repetition_penalty=1.3)
    plain = [minillm.generate(word_model, p, params, max_new_tokens=16).ids for p in PROMPTS]
    for draft in ("ngram", "layers:2"):
        spec = [minillm.generate(word_model, p, params, max_new_tokens=16, speculative=draft).ids for p in PROMPTS]
        assert spec == plain
        batch = minillm.generate_batch(word_model, PROMPTS, params, max_new_tokens=16, block_size=4,
                                       speculative=Speculative(draft, num_tokens=5))  # fmt: skip
        assert [r.ids for r in batch] == plain
        assert sum(r.metrics.drafted_tokens for r in batch) > 0


def exact_continuations(model: Model, prompt: str, params, n: int = 3) -> dict[tuple, float]:
    """P(first n new tokens) under the plain sampler: every path through the top-k support."""
    ids = model.tokenizer.encode(prompt)
    out = {}

    def walk(prefix: list[int], prob: float):
        if len(prefix) == n:
            out[tuple(prefix)] = prob
            return
        seq = [*ids, *prefix]
        logits = model.transformer.forward(np.asarray(seq), None)[-1]
        p = distribution(logits, params, seq)
        for t in np.flatnonzero(p):
            walk([*prefix, int(t)], prob * p[t])

    walk([], 1.0)
    return out


@pytest.mark.parametrize("draft", ["ngram", "layers:2", "self-int8"])
def test_sampled_distribution_is_the_models(word_model, draft):
    """2,000 seeded runs of 4 tokens (one verification of 2 drafts covers tokens 2-3): the empirical
    distribution of the first 3 tokens against the exact one, chi-square with a generous threshold
    (tail probability about 1e-6; cells expected below 5 pooled)."""
    params = minillm.SamplingParams(temperature=0.8, top_k=4, repetition_penalty=1.2)
    prompt = "AB C DEF AB C DEF AB"
    exact = exact_continuations(word_model, prompt, params)
    n = 2000
    counts: dict[tuple, int] = {}
    spec = Speculative(draft, num_tokens=2, adaptive=False, prompt_lookup_min=1)
    drafted = 0
    for seed in range(n):
        r = minillm.generate(word_model, prompt, params, max_new_tokens=4, rng=np.random.default_rng(seed),
                             speculative=spec)  # fmt: skip
        counts[tuple(r.ids[:3])] = counts.get(tuple(r.ids[:3]), 0) + 1
        drafted += r.metrics.drafted_tokens
    assert drafted >= n // 4  # the runs did verify drafts (ngram: when the first token had a match)
    assert set(counts) <= set(exact)
    keys = sorted(exact, key=exact.get, reverse=True)
    big = [key for key in keys if exact[key] * n >= 5]
    observed = [counts.get(key, 0) for key in big] + [n - sum(counts.get(key, 0) for key in big)]
    expected = [exact[key] * n for key in big] + [n - sum(exact[key] * n for key in big)]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    dof = len(observed) - 1
    z = 4.75  # one-sided normal quantile of about 1e-6; Wilson-Hilferty's chi-square quantile
    threshold = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi_square(np.array(observed), np.array(expected)) < threshold


# --- stops inside an accepted run, the draft interface --------------------------------------------------
class Oracle(Draft):
    """A draft that knows the plain greedy answer (so every draft is accepted)."""

    def __init__(self, answer: list[int], prompt_len: int):
        self.answer, self.prompt_len = answer, prompt_len

    def propose(self, tokens, k, choose):
        done = len(tokens) - self.prompt_len
        return self.answer[done : done + k], None


@pytest.mark.parametrize("options", [{}, {"stop": ["DE"]}, {"stop_token_ids": [[5]]}, {"max_new_tokens": 7}])
def test_stops_inside_an_accepted_run(word_model, options):
    prompt = "AB C DEF AB C"
    options = {"max_new_tokens": 20, **options}
    plain = minillm.generate(word_model, prompt, **options)
    full = minillm.generate(word_model, prompt, max_new_tokens=40)
    n = len(word_model.tokenizer.encode(prompt))
    oracle = Speculative(Oracle(full.ids, n), num_tokens=8, adaptive=False)
    spec = minillm.generate(word_model, prompt, speculative=oracle, **options)
    assert (spec.ids, spec.text, spec.stop_reason) == (plain.ids, plain.text, plain.stop_reason)
    m = spec.metrics
    assert m.rejections == 0  # an oracle is always right ...
    assert m.target_passes == 1 + math.ceil((len(spec.ids) - 1) / 9)  # ... so each pass gives k + 1 = 9
    # accepted counts the drafts the answer kept, none past the stop: each id but the prefill's is a kept
    # draft or a verify pass's own token, and the last pass has none of its own when the stop is a draft
    passes = m.target_passes - 1
    last = len(spec.ids) - 1 - 9 * (passes - 1)  # the ids the last pass gave
    drafted = min(8, options["max_new_tokens"] - 2 - 9 * (passes - 1))  # what it proposed (room for its own)
    assert m.accepted_tokens == len(spec.ids) - 1 - passes + (last <= drafted)


class RightTwiceThenWrong(Draft):
    """Proposes the plain greedy answer's next ``k`` ids with the third one wrong: two kept, then a rejection."""

    def __init__(self, answer: list[int], prompt_len: int):
        self.answer, self.prompt_len = answer, prompt_len

    def propose(self, tokens, k, choose):
        done = len(tokens) - self.prompt_len
        ids = list(self.answer[done : done + k])
        if len(ids) > 2:
            ids[2] = (ids[2] + 1) % 108  # any id but the model's argmax
        return ids, None


def test_alpha_counts_the_positions_checked_not_the_drafts():
    """Worked by hand: k = 4 fixed, 16 new tokens. The prefill gives 1; four passes draft 4, keep 2, reject
    the third (3 tokens each); the last pass may draft only 2 (the budget keeps one token for the model):
    both kept, plus the bonus. Kept 10, drafted 18, rejections 4: the positions checked are 10 + 4."""
    assert per_position_acceptance(10, 4) == 10 / 14
    assert per_position_acceptance(0, 0) != per_position_acceptance(0, 0)  # NaN: nothing was checked
    assert expected_tokens_per_pass(0.5, 2) == 1.75 and expected_tokens_per_pass(1.0, 4) == 5
    assert expected_tokens_per_pass(0.0, 8) == 1.0


def test_rejections_are_counted_once_per_rejecting_pass(word_model):
    prompt = "AB C DEF AB C"
    full = minillm.generate(word_model, prompt, max_new_tokens=40)
    n = len(word_model.tokenizer.encode(prompt))
    spec = Speculative(RightTwiceThenWrong(full.ids, n), num_tokens=4, adaptive=False)
    r = minillm.generate(word_model, prompt, max_new_tokens=16, speculative=spec)
    assert r.ids == full.ids[:16]
    m = r.metrics
    assert (m.drafted_tokens, m.accepted_tokens, m.rejections, m.verify_steps, m.target_passes) == (18, 10, 4, 5, 6)
    alpha = per_position_acceptance(m.accepted_tokens, m.rejections)
    assert alpha == 10 / 14 != m.accepted_tokens / m.drafted_tokens  # kept / drafted would say 10 / 18


def test_the_formula_is_what_independent_acceptances_yield():
    """Passes simulated with each draft kept independently with probability 0.7 (seeded): the tokens per
    pass match (1 - a^(k+1)) / (1 - a) at a = per_position_acceptance of the counts, and that a is 0.7;
    kept / drafted is far below it (the drafts after a rejection were never checked)."""
    rng, true_alpha = np.random.default_rng(0), 0.7
    for k in (2, 4, 8):
        kept = rejections = 0
        passes = 20_000
        for _ in range(passes):
            run = 0
            while run < k and rng.random() < true_alpha:
                run += 1
            kept, rejections = kept + run, rejections + (run < k)
        alpha = per_position_acceptance(kept, rejections)
        assert abs(alpha - true_alpha) < 0.01, (k, alpha)
        measured = (kept + passes) / passes
        assert abs(measured / expected_tokens_per_pass(alpha, k) - 1) < 0.01, (k, measured)
        assert kept / (k * passes) < true_alpha - 0.05  # the old estimate: 0.60, 0.44, 0.25 for k = 2, 4, 8


def test_next_k_grows_on_a_full_run_and_shrinks_on_a_rejection():
    assert next_k(1, 1, 1, most=4) == 2  # every draft kept: one more next time
    assert next_k(4, 4, 4, most=4) == 4  # ... never above num_tokens
    assert next_k(4, 2, 2, most=8) == 5  # a short proposal (the lookup ran out) all kept: still grows
    assert next_k(6, 6, 2, most=8) == 3  # two kept, then a rejection: the kept run and one more
    assert next_k(3, 3, 0, most=8) == 2  # nothing kept: one fewer ...
    assert next_k(1, 1, 0, most=8) == 1  # ... but at least one (a pass without a match drafts nothing)
    assert next_k(5, 0, 0, most=8) == 5  # nothing proposed: k unchanged


def test_adaptive_k_ramps_up_with_an_oracle(word_model):
    """An always-right draft under the adaptive rule asks 1, 2, 3 .. 8 drafts: passes give 2, 3, 4 .. 9 tokens."""
    prompt = "AB C DEF AB C"
    full = minillm.generate(word_model, prompt, max_new_tokens=40)
    n = len(word_model.tokenizer.encode(prompt))
    spec = minillm.generate(word_model, prompt, max_new_tokens=40, speculative=Speculative(Oracle(full.ids, n), 8))
    assert spec.ids == full.ids
    # after the prefill's token: 2 + 3 + ... + 8 = 35 tokens in 7 passes, then 4 left (k capped by the budget)
    assert spec.metrics.target_passes == 1 + 7 + 1
    assert spec.metrics.drafted_tokens == spec.metrics.accepted_tokens == 1 + 2 + 3 + 4 + 5 + 6 + 7 + 3


def test_eos_inside_an_accepted_run(word_model):
    """A draft that proposes EOS where the model's argmax is EOS: the run ends there, nothing after."""
    model = word_model
    logits_eos = np.full(108, -5.0, dtype=np.float32)

    class EndsSoon(Draft):
        def propose(self, tokens, k, choose):
            return [1, 3, 3][:k], None  # EOS, then tokens that must never be emitted

    from minillm.runtime import generate as generate_module

    def verify_step(model, token_id, drafted, cache):  # a verification: its k + 1 rows of logits, EOS first
        cache.advance(1 + len(drafted))
        out = np.tile(logits_eos, (1 + len(drafted), 1))
        out[0, 1] = 5.0  # argmax after [last]: EOS (id 1)
        return out

    real = generate_module.verify_step
    generate_module.verify_step = verify_step
    try:
        r = minillm.generate(model, "AB C", max_new_tokens=10, speculative=Speculative(EndsSoon(), num_tokens=3))
    finally:
        generate_module.verify_step = real
    assert r.ids[-1] == 1 and r.stop_reason is minillm.StopReason.EOS
    assert r.metrics.accepted_tokens == 1 and len(r.ids) == 2  # the first token, then the accepted EOS


def test_ngram_lookup_proposes_what_followed_the_longest_match():
    draft = NgramDraft(min_n=1, max_n=3)
    assert draft.propose([5, 6, 7, 8, 9, 5, 6, 7], 3)[0] == [8, 9, 5]  # "5 6 7" seen before: what came after
    assert draft.propose([1, 2, 3, 4, 2, 9, 4, 2], 2)[0] == [9, 4]  # "4 2" (n=2) beats the later "2"
    assert draft.propose([1, 2, 3], 4) == ([], None)  # no match: nothing proposed (a plain decode step)
    assert NgramDraft(min_n=2, max_n=2).propose([1, 2, 3, 2], 3)[0] == []  # "3 2" never seen before


def test_bad_speculative_arguments_name_the_value(word_model):
    for kwargs, match in [
        ({"num_tokens": 0}, "num_tokens .* 1..16, got 0"),
        ({"num_tokens": 17}, "got 17"),
        ({"draft": "eagle"}, "unknown draft 'eagle'; the drafts are ngram, self-int8, self-gguf, layers:K"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max, got 3 and 2"),
    ]:
        with pytest.raises(InvalidRequestError, match=match):
            Speculative(**kwargs)
    for k in (0, 4):
        with pytest.raises(InvalidRequestError, match=f"'layers:{k}'.* 4 layers, so K must be in 1..3"):
            minillm.generate(word_model, "AB", speculative=f"layers:{k}")

    class Foreign(Draft):
        vocab_size = 50_000

    with pytest.raises(InvalidRequestError, match="vocabulary of 50,000 ids but the model has 108"):
        minillm.generate(word_model, "AB", speculative=Speculative(Foreign()))


# --- rollback: contiguous and paged -----------------------------------------------------------------------
def test_rollback_equals_a_cache_that_never_saw_the_rejected(tiny_llama):
    _, model = tiny_llama
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 300, size=13)
    rejected = rng.integers(0, 300, size=6)
    clean = KVCache.for_model(model.config, 40)
    model.forward(ids, clean)
    want = model.forward(np.array([7]), clean)[0]
    for make in (lambda: KVCache.for_model(model.config, 40), lambda: paged(model, block_size=4)):
        cache = make()
        model.forward(ids, cache)  # 13 positions: blocks of 4 -> 3 full + 1 slot of the 4th
        model.forward(rejected, cache)  # 19 positions: into a 5th block, across two boundaries
        cache.truncate(13)
        got = model.forward(np.array([7]), cache)[0]
        np.testing.assert_allclose(got, want, atol=1e-5)


def paged(model, block_size):
    pool = KVCachePool(model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim,
                       num_blocks=12, block_size=block_size)  # fmt: skip
    seq = pool.sequence(40)
    pool.grow(seq, 40)
    return seq


def test_paged_truncate_frees_whole_tail_blocks():
    pool = KVCachePool(1, 1, 2, num_blocks=8, block_size=4)
    seq = pool.sequence(32)
    pool.allocate(seq, list(range(10)))  # 10 positions -> 3 blocks (4 + 4 + 2)
    seq.length = 10
    pool.grow(seq, 6)  # 16 positions -> 4 blocks
    seq.length = 16
    assert (len(seq.block_table), pool.num_free_blocks) == (4, 4)
    tail = seq.block_table[2:]
    seq.truncate(9)  # keep 0..8: blocks 0, 1 and one slot of block 2; block 3 goes back
    assert (len(seq.block_table), pool.num_free_blocks, seq.length) == (3, 5, 9)
    seq.truncate(8)  # exactly two blocks: block 2 goes back too
    assert (seq.block_table, pool.num_free_blocks) == (tail[:0] or seq.block_table, 6)
    assert len(seq.block_table) == 2 and all(pool.ref_count[b] == 0 for b in tail)
    with pytest.raises(InvalidRequestError, match="cannot truncate a sequence of length 8 to 9"):
        seq.truncate(9)


def test_paged_truncate_never_writes_into_a_shared_block():
    """Two sequences share a cached prompt block; truncating one into that block copies it first."""
    pool = KVCachePool(1, 1, 2, num_blocks=8, block_size=4)
    a = pool.sequence(16)
    pool.allocate(a, [1, 2, 3, 4, 5])
    pool.keys[:] = np.arange(pool.keys.size, dtype=np.float32).reshape(pool.keys.shape)
    a.length = 5
    pool.register_full_blocks(a, [1, 2, 3, 4, 5])
    b = pool.sequence(16)
    assert pool.allocate(b, [1, 2, 3, 4, 9]) == 4  # block 0 of a is b's too
    shared = a.block_table[0]
    assert pool.ref_count[shared] == 2
    before = pool.keys[:, :, shared * 4 : shared * 4 + 4].copy()
    b.length = 4
    b.truncate(2)  # b keeps 2 positions of the shared block: it gets a copy of its own
    assert b.block_table[0] != shared and pool.ref_count[shared] == 1
    np.testing.assert_array_equal(pool.keys[:, :, b.block_table[0] * 4 :][:, :, :2], before[:, :, :2])
    np.testing.assert_array_equal(pool.keys[:, :, shared * 4 : shared * 4 + 4], before)
    assert pool.block_hash[shared] is not None  # a's block keeps its name in the prefix cache


# --- the real model -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_incident_summary_with_ngram_takes_fewer_passes_than_tokens(smollm2):
    text = (ROOT / "examples" / "incident.txt").read_text()
    prompt = [{"role": "user", "content": text + "\n\nSummarize this incident report in two bullets."}]
    plain = minillm.generate(smollm2, prompt, max_new_tokens=48)
    spec = minillm.generate(smollm2, prompt, max_new_tokens=48, speculative="ngram")
    assert spec.ids == plain.ids
    assert plain.metrics.target_passes == len(plain.ids) == 48
    assert spec.metrics.target_passes < len(spec.ids)
    assert spec.metrics.target_passes + spec.metrics.accepted_tokens == 48


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["ngram", "layers:6", "self-int8"])
def test_smollm2_greedy_equals_plain(smollm2, draft):
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,", "Once upon a time",
               [{"role": "user", "content": "List three colors."}]]  # fmt: skip
    for prompt in prompts:
        plain = minillm.generate(smollm2, prompt, max_new_tokens=16)
        spec = minillm.generate(smollm2, prompt, max_new_tokens=16, speculative=Speculative(draft, num_tokens=4))
        assert spec.ids == plain.ids, prompt


# --- the server: a body field and a server default ------------------------------------------------------------
def test_server_speculative_body_field_and_default(word_model):
    from fastapi.testclient import TestClient

    from minillm.serve.app import create_app
    from minillm.serve.metrics import ServerMetrics
    from minillm.serve.worker import Worker

    plain = minillm.generate(word_model, PROMPTS[0], max_new_tokens=12)
    default = minillm.generate(word_model, PROMPTS[0], max_new_tokens=12,
                               speculative=Speculative("layers:2", num_tokens=3)).metrics  # the server's default
    worker = Worker(str(word_model.path), metrics=ServerMetrics(), served_name="word", warmup=False, verbosity="quiet",
                    kv_cache_mib=1, block_size=4, speculative=Speculative("layers:2", num_tokens=3))  # fmt: skip
    with TestClient(create_app(worker)) as client:
        for _ in range(600):
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        body = {"model": "word", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
        counts = ("target_passes", "drafted_tokens", "accepted_tokens", "rejections")
        for extra in ({}, {"speculative": "ngram", "num_speculative_tokens": 5}):
            out = client.post("/v1/completions", json={**body, **extra}).json()
            assert out["choices"][0]["text"] == plain.text
            usage = out["usage"]
            assert usage["target_passes"] + usage["accepted_tokens"] == 12 and usage["drafted_tokens"] > 0
            assert usage["rejections"] <= usage["target_passes"]  # at most one rejection a pass
            if not extra:  # the server's default: the same counts as generate's
                assert [usage[k] for k in counts] == [getattr(default, k) for k in counts]
        off = client.post("/v1/completions", json={**body, "speculative": "off"}).json()["usage"]
        assert off["target_passes"] is None and off["rejections"] is None and off["completion_tokens"] == 12
        bad = client.post("/v1/completions", json={**body, "speculative": "layers:9"})
        assert bad.status_code == 400 and "K must be in 1..3" in bad.json()["error"]["message"]


def test_trace_shows_each_verification_and_the_summary_rates(word_model):
    import io

    from rich.console import Console

    from minillm.observe.events import Tracer

    out = io.StringIO()
    tracer = Tracer(Console(file=out, width=160), verbosity="full", live=False)
    r = minillm.generate(word_model, PROMPTS[2], max_new_tokens=16, tracer=tracer, speculative="ngram")
    verifies = [e.data for e in tracer.events if e.phase == "verify"]
    m = r.metrics
    assert len(verifies) == m.verify_steps > 0
    assert sum(v["accepted"] for v in verifies) == m.accepted_tokens
    assert sum(len(v["drafted"]) for v in verifies) == m.drafted_tokens
    assert verifies[-1]["acceptance_rate"] == m.accepted_tokens / m.drafted_tokens
    summary = next(e.data for e in tracer.events if e.phase == "summary")
    assert summary["tokens_per_pass"] == len(r.ids) / m.target_passes
    text = out.getvalue()
    assert text.count("  verify  ") == m.verify_steps
    assert f"{m.accepted_tokens}/{m.drafted_tokens} drafts kept" in text and "formula" in text


def test_summary_formula_takes_alpha_per_position_checked(word_model):
    """The right-twice-then-wrong draft (18 drafted, 10 kept, 4 rejections in 5 verifications): the summary's
    formula is at alpha 10/14 and k 3.6, (1 - (5/7)^4.6) / (2/7) = 2.76; at kept / drafted it would say 2.10."""
    import io

    from rich.console import Console

    from minillm.observe.events import Tracer

    prompt = "AB C DEF AB C"
    full = minillm.generate(word_model, prompt, max_new_tokens=40)
    n = len(word_model.tokenizer.encode(prompt))
    out = io.StringIO()
    tracer = Tracer(Console(file=out, width=160), verbosity="full", live=False)
    spec = Speculative(RightTwiceThenWrong(full.ids, n), num_tokens=4, adaptive=False)
    minillm.generate(word_model, prompt, max_new_tokens=16, speculative=spec, tracer=tracer)
    text = out.getvalue()
    assert round(expected_tokens_per_pass(10 / 14, 3.6), 2) == 2.76  # at kept / drafted: 2.10
    assert "(formula 2.76)" in text and "(formula 2.10)" not in text


def test_cli_and_serve_flags_parse():
    from minillm.cli import build_parser

    args = build_parser().parse_args(["run", "hi", "--speculative", "layers:3", "--num-speculative-tokens", "6"])
    assert (args.speculative, args.num_speculative_tokens) == ("layers:3", 6)
    args = build_parser().parse_args(["serve", "m", "--speculative", "ngram"])
    assert (args.speculative, args.num_speculative_tokens) == ("ngram", 4)


@pytest.mark.slow
def test_a_draft_equal_to_the_model_accepts_everything(smollm2):
    """SmolLM2's float32 weights are dequantized from its Q4_1 GGUF, so the self-gguf draft computes the
    model's own logits (another product order): every draft is kept, one pass per k + 1 tokens."""
    plain = minillm.generate(smollm2, "The capital of France is", max_new_tokens=21)
    spec = minillm.generate(smollm2, "The capital of France is", max_new_tokens=21,
                            speculative=Speculative("self-gguf", num_tokens=4, adaptive=False))  # fmt: skip
    assert spec.ids == plain.ids
    m = spec.metrics
    assert (m.drafted_tokens, m.accepted_tokens, m.target_passes) == (16, 16, 1 + 20 // 5)


# --- logprobs: the model's own p at every accepted, resampled and bonus token ---------------------------
def assert_same_logprobs(got: list[dict], want: list[dict]) -> None:
    assert [e["id"] for e in got] == [e["id"] for e in want]
    for g, w in zip(got, want, strict=True):
        assert abs(g["logprob"] - w["logprob"]) < 1e-5, (g, w)
        assert [i for i, _ in g["top"]] == [i for i, _ in w["top"]]
        np.testing.assert_allclose([lp for _, lp in g["top"]], [lp for _, lp in w["top"]], atol=1e-5)


@pytest.mark.parametrize("draft", ["ngram", "layers:2", "self-int8"])
def test_greedy_logprobs_equal_plain_decodings(word_model, draft):
    params = minillm.SamplingParams(temperature=0.0, top_logprobs=3, repetition_penalty=1.1)
    for prompt in PROMPTS[:3]:
        plain = minillm.generate(word_model, prompt, params, max_new_tokens=16)
        spec = minillm.generate(word_model, prompt, params, max_new_tokens=16, speculative=Speculative(draft, 4))
        assert spec.metrics.accepted_tokens > 0  # some tokens came out of a verification
        assert spec.ids == plain.ids and len(spec.logprobs) == len(spec.ids) >= 12
        assert_same_logprobs(spec.logprobs, plain.logprobs)


def test_sampled_logprobs_are_the_models_p(word_model):
    """Sampled: each token's logprob is the model's own log p(token) (log softmax of its raw logits) after
    the tokens before it, and its ``sampled_logprob`` that of the plain sampler's distribution, computed
    here by a fresh forward over the whole prefix."""
    params = minillm.SamplingParams(temperature=0.9, top_k=6, top_logprobs=2, seed=3)
    prompt = "X Y Z X Y Z X"
    r = minillm.generate(word_model, prompt, params, max_new_tokens=12, speculative=Speculative("layers:3", 4))
    assert r.metrics.accepted_tokens > 0
    ids = word_model.tokenizer.encode(prompt).tolist()
    want = []
    for i, t in enumerate(r.ids):
        seq = ids + r.ids[:i]
        logits = word_model.transformer.forward(np.asarray(seq), None)[-1]
        probs = sampling.probabilities(sampling.process_logits(logits, params, seq, r.ids[:i]))
        want.append(sampling.model_logprobs(logits, t, 2, probs))
    assert_same_logprobs(r.logprobs, want)
    np.testing.assert_allclose([e["sampled_logprob"] for e in r.logprobs], [e["sampled_logprob"] for e in want],
                               atol=1e-5)  # fmt: skip


# --- with a constraint: each draft checked against the grammar's mask, the matcher rolled back -------------
#: words of the scripted vocabulary: a run of X/Y/Z/DE/w, then 'KL' (forced after the ninth: the only way on)
WORD_GRAMMAR = r"(X|Y|Z|DE|w){3,9}KL(X|Y|Z|AB|C)*"


@pytest.fixture(scope="module")
def grammar_model(word_model, tmp_path_factory) -> Model:
    """The word model with its tokenizer's decoder told as ByteLevel (llguidance reads no Fuse decoder;
    the pieces are ASCII, so both decode 'AB', 'C' to 'ABC')."""
    import json
    import shutil

    folder = tmp_path_factory.mktemp("spec-grammar-model")
    for f in word_model.path.iterdir():
        shutil.copy(f, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    m = word_model
    return Model("word", folder, m.config, Tokenizer.from_folder(folder), m.transformer, None)


@pytest.mark.parametrize("draft", ["ngram", "layers:2", "layers:3"])
def test_greedy_with_a_grammar_equals_constrained_plain(grammar_model, draft):
    from minillm import Constraint

    params = minillm.SamplingParams(temperature=0.0, top_logprobs=2)
    constraint = Constraint.regex(WORD_GRAMMAR)
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = minillm.generate(grammar_model, prompt, params, max_new_tokens=16, constraint=constraint)
        assert "KL" in plain.text
        for k in (1, 4):
            spec = minillm.generate(grammar_model, prompt, params, max_new_tokens=16, constraint=constraint,
                                    speculative=Speculative(draft, num_tokens=k))  # fmt: skip
            assert (spec.ids, spec.text, spec.stop_reason) == (plain.ids, plain.text, plain.stop_reason), (prompt, k)
            assert_same_logprobs(spec.logprobs, plain.logprobs)
            drafted += spec.metrics.drafted_tokens
            accepted += spec.metrics.accepted_tokens
    assert drafted > 0 and (accepted > 0 or draft == "ngram")  # the random model copies little


def test_along_grammar_cuts_at_a_refused_draft_and_rolls_the_matcher_back(grammar_model):
    from minillm import Constraint
    from minillm.runtime.constraint import ConstraintState
    from minillm.runtime.speculative import along_grammar

    state = ConstraintState(grammar_model, Constraint.regex(WORD_GRAMMAR))
    ids = {w: int(grammar_model.tokenizer.encode(w, add_special_tokens=False)[0]) for w in ("X", "Y", "AB", "KL")}
    before = state.allowed()
    kept, masks = along_grammar(state, [ids["X"], ids["Y"], ids["AB"], ids["X"]])
    assert kept == [ids["X"], ids["Y"]] and len(masks) == 3  # AB is not allowed before the forced run
    assert masks[2][ids["X"]] and not masks[2][ids["AB"]]
    np.testing.assert_array_equal(state.allowed(), before)  # the matcher is where it started
    for _ in range(7):
        state.advance(ids["X"])
    kept, masks = along_grammar(state, [ids["X"], ids["X"], ids["KL"]])
    assert kept == [ids["X"]] and len(masks) == 2  # after a ninth X the grammar forces KL: the request adds it
    state.advance(ids["X"])
    kept, masks = along_grammar(state, [ids["X"], ids["KL"]])
    assert kept == [] and len(masks) == 1
    assert state.advance(ids["X"]) == [ids["KL"]]  # ... as here


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["ngram", "layers:20"])
def test_smollm2_greedy_with_a_schema_equals_constrained_plain(smollm2, draft):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
              "city": {"enum": ["Paris", "Berlin", "Rome"]}, "age": {"type": "integer"}},
              "required": ["name", "city", "age"], "additionalProperties": False}  # fmt: skip
    ask = 'Describe Ana, 31, from Rome, as JSON: {"name": "Ana", "city": "Rome", "age": 31}'
    prompt = [{"role": "user", "content": ask}]
    plain = minillm.generate(smollm2, prompt, max_new_tokens=40, constraint=schema)
    spec = minillm.generate(smollm2, prompt, max_new_tokens=40, constraint=schema, speculative=draft)
    assert spec.ids == plain.ids and spec.text == plain.text
    assert spec.metrics.accepted_tokens > 0


def test_batch_with_a_grammar_equals_constrained_plain(grammar_model):
    from minillm import Constraint

    constraint = Constraint.regex(WORD_GRAMMAR)
    plain = [minillm.generate(grammar_model, p, max_new_tokens=16, constraint=constraint).ids for p in PROMPTS]
    batch = minillm.generate_batch(grammar_model, PROMPTS, max_new_tokens=16, block_size=4,
                                   per_prompt=[{"constraint": constraint}] * len(PROMPTS),
                                   speculative=Speculative("layers:3", num_tokens=4))  # fmt: skip
    assert [r.ids for r in batch] == plain
    assert sum(r.metrics.accepted_tokens for r in batch) > 0
