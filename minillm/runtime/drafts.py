"""Drafts for speculative decoding: cheap guesses of the next ``k`` tokens (``speculative.py`` checks them).

A draft is anything with ``propose(tokens, k, choose) -> (ids, q)``. One in four lines::

    class RepeatLast(Draft):                   # guess that the last token comes again, k times
        def propose(self, tokens, k, choose):
            return [tokens[-1]] * k, None      # deterministic: no q (one-hot on each id)

``tokens``: the prompt's ids and every new token so far; ``k``: how many to propose at most (fewer,
even none, is fine: none means a plain decode step). A draft that is a model samples its tokens
with ``choose(logits, seen) -> (id, q_row)``, the request's own processors (``q_row`` None when
greedy), and returns ``q`` ``[len(ids), vocab]``: the distribution each id was drawn from.

    ngram       prompt lookup: the last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
                found earlier in the prompt or the text so far; propose what followed them
    self-int8   the model itself with its matrices held at int8 (``held.py``), drafting for itself
    self-gguf   the model itself read from its GGUF file, blocks kept packed (SmolLM2: Q4_1)
    layers:K    the model's first K layers, then its final norm and head: early exit

The model drafts keep a KV cache of their own, one per request; each proposal first feeds the
tokens the draft has not seen (after a rejection, the cache is cut back to what still agrees).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from minillm.errors import InvalidRequestError
from minillm.model.kv_cache import KVCache
from minillm.model.transformer import Transformer

if TYPE_CHECKING:
    from minillm.runtime.loading import Model

#: ``choose(logits [vocab], seen ids) -> (id, q [vocab] float64 or None)``: the request's sampler
Choose = Callable[[np.ndarray, Sequence[int]], tuple[int, "np.ndarray | None"]]


class Draft:
    """The interface: :meth:`propose`; a draft with per-request state also gives :meth:`for_request`
    (a fresh copy for one request) and :meth:`release`. ``vocab_size``: checked against the model's."""

    vocab_size: int | None = None

    def propose(self, tokens: list[int], k: int, choose: Choose) -> tuple[list[int], np.ndarray | None]:
        """Up to ``k`` ids to follow ``tokens``, and ``q`` ``[len(ids), vocab]`` (None: deterministic)."""
        raise NotImplementedError

    def for_request(self, max_seq_len: int) -> Draft:
        """This draft for one request of at most ``max_seq_len`` positions (default: itself)."""
        return self

    def release(self) -> None:
        """Free what the request held (a cache)."""


class NgramDraft(Draft):
    """Prompt lookup (transformers' ``prompt_lookup_num_tokens``, vLLM's ``ngram``): find the last
    ``n`` tokens earlier in ``tokens``, longest ``n`` first, and propose the ``k`` that followed
    the most recent match. No model, no cost to speak of; nothing proposed without a match."""

    def __init__(self, min_n: int = 1, max_n: int = 3):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens, k, choose=None):
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [len - n, n]: every earlier n-gram
            starts = np.flatnonzero((windows == ids[-n:]).all(axis=1))  # where the last n tokens occurred
            if len(starts):
                follow = starts[-1] + n  # the most recent match; what came after it
                return ids[follow : follow + k].tolist(), None
        return [], None

    def __repr__(self) -> str:
        return f"NgramDraft(n={self.max_n}..{self.min_n})"


class ModelDraft(Draft):
    """A smaller or cheaper transformer of the same vocabulary, drafting autoregressively with its own
    KV cache: ``k`` forward passes per proposal (the first feeds what it has not seen yet)."""

    def __init__(self, transformer: Transformer, name: str = "model", max_seq_len: int | None = None):
        self.transformer, self.name = transformer, name
        self.vocab_size = transformer.config.vocab_size
        self.cache = None if max_seq_len is None else KVCache.for_model(transformer.config, max_seq_len)
        self.fed: list[int] = []  # the ids whose keys and values are in the cache

    def for_request(self, max_seq_len: int) -> ModelDraft:
        return ModelDraft(self.transformer, self.name, max_seq_len)

    def propose(self, tokens, k, choose):
        if self.cache is None:
            raise InvalidRequestError(
                "a ModelDraft needs for_request(max_seq_len) before propose (it makes the cache)."
            )
        m = _common_prefix(self.fed, tokens, limit=len(tokens) - 1)  # feed at least the last token
        self.cache.truncate(m)
        logits = self.transformer.forward(np.asarray(tokens[m:], dtype=np.int64), self.cache, last_only=True)[0]
        self.fed, seen, ids, rows = list(tokens), list(tokens), [], []
        for j in range(k):
            token, q = choose(logits, seen)
            ids.append(token)
            rows.append(q)
            seen.append(token)
            if j < k - 1:  # the last draft is never fed: the model verifies it
                logits = self.transformer.forward(np.array([token], dtype=np.int64), self.cache)[0]  # [vocab]
                self.fed.append(token)
        return ids, None if rows[0] is None else np.stack(rows)

    def release(self) -> None:
        if self.cache is not None:
            self.cache.free()

    def __repr__(self) -> str:
        return f"ModelDraft({self.name}, layers={self.transformer.config.num_hidden_layers})"


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def make_draft(spec, model: Model, max_seq_len: int) -> Draft:
    """The draft of ``spec`` (a ``speculative.Speculative``) for one request on ``model``.

    Raises:
        InvalidRequestError: ``layers:K`` with K outside ``1..layers-1``; ``self-int8`` on weights
            not held as float32; a draft whose vocabulary is not the model's.
    """
    d, vocab = spec.draft, model.config.vocab_size
    if d == "ngram":
        return NgramDraft(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if isinstance(d, str):
        d = ModelDraft(draft_transformer(model, d), d)
    if getattr(d, "vocab_size", None) not in (None, vocab):
        raise InvalidRequestError(
            f"the draft {d!r} has a vocabulary of {d.vocab_size:,} ids but the model has {vocab:,}; a draft must "
            "use the model's tokenizer (its ids are the model's ids)."
        )
    return d.for_request(max_seq_len) if hasattr(d, "for_request") else d


def draft_transformer(model: Model, name: str) -> Transformer:
    """The transformer behind ``self-int8``, ``self-gguf`` or ``layers:K``, built from the model's own
    weights once and kept on the model (``model.drafts``) for later requests."""
    drafts = model.__dict__.setdefault("drafts", {})
    if name not in drafts:
        drafts[name] = _build(model, name)
    return drafts[name]


def _build(model: Model, name: str) -> Transformer:
    from minillm.model.gguf_weights import load_gguf_weights
    from minillm.model.weights import hold_weights
    from minillm.sources.hub import resolve_gguf

    config, weights = model.config, model.transformer.weights
    if name == "self-gguf":
        return Transformer(config, load_gguf_weights(resolve_gguf(model.name, progress=False), config))
    if name == "self-int8":
        if weights.weight_dtype != "float32" or weights.mapped:
            raise InvalidRequestError(
                f"draft self-int8 quantizes the model's float32 weights, but they are held as {weights.weight_dtype}"
                f"{' (memory-mapped)' if weights.mapped else ''}; load with weight_dtype='float32' (no mmap), or "
                "use the ngram or layers:K draft."
            )
        copy = replace(weights, layers=[replace(layer, lora=dict(layer.lora)) for layer in weights.layers])
        return Transformer(config, hold_weights(copy, "int8"))
    n_layers, k = config.num_hidden_layers, int(name.removeprefix("layers:"))
    if not 1 <= k <= n_layers - 1:
        raise InvalidRequestError(
            f"draft {name!r}: the early-exit draft runs the first K of the model's {n_layers} layers, so K must be "
            f"in 1..{n_layers - 1}."
        )
    sub = replace(config, num_hidden_layers=k, layer_types=config.layer_types[:k])
    return Transformer(sub, replace(weights, layers=weights.layers[:k]))
