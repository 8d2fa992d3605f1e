"""The request lifecycle, one small function per phase.

    load -> tokenize -> prefill -> sample -> decode_step ... -> detokenize -> stop -> free

``generate`` and ``stream`` are these phases in a loop; read them to see the whole request. Each
function takes an optional ``tracer`` (``trace.Tracer``); without one it does no tracing work.
Lifetimes follow llama2.c: a :class:`Model` (weights, tokenizer) lives across requests; a
:class:`~minillm.kv_cache.KVCache` lives for one request and is reset or freed at its end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import sampling
from .config import ModelConfig
from .detokenize import IncrementalDetokenizer
from .detokenize import detokenize as _detokenize
from .errors import ContextWindowExceeded, InvalidRequestError
from .hub import ResolvedModel, resolve_model
from .kv_cache import KVCache
from .metrics import RequestMetrics
from .model import Transformer
from .sampling import SamplingParams
from .stopping import StopCriteria, StopReason
from .tokenizer import Tokenizer
from .trace import Tracer
from .weights import load_weights

Prompt = str | list[dict]


@dataclass
class Model:
    """What ``load`` returns and every request shares: config, tokenizer, weights (in ``transformer``)."""

    name: str
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    transformer: Transformer
    resolved: ResolvedModel
    load_seconds: dict[str, float] = field(default_factory=dict)  # per step, seconds

    @property
    def load_s(self) -> float:
        """Total load time in seconds (resolve + read + convert + tokenizer)."""
        return sum(self.load_seconds.values())


# --- load --------------------------------------------------------------------------------------
def load(name_or_path: str | os.PathLike | None = None, *, tracer: Tracer | None = None,
         progress: bool = True) -> Model:
    """Load a model by manifest name (fetched and cached on first use) or from a local folder.

    Args:
        name_or_path: a name from ``weights_manifest.toml`` (``minillm models``), or a folder with
            ``config.json``, ``*.safetensors``, ``tokenizer.json``. None: the manifest's default.
        progress: show rich progress bars while fetching or converting.

    Raises:
        ModelNotFoundError, DownloadError, ChecksumMismatchError: while resolving the model.
        ConfigError, WeightsError, TokenizerError: while reading the folder.
    """
    from .manifest import default_model_name

    start = tracer.now() if tracer else 0.0
    t0 = time.perf_counter()
    resolved = resolve_model(name_or_path if name_or_path is not None else default_model_name(),
                             progress=progress)
    t1 = time.perf_counter()
    config = ModelConfig.from_folder(resolved.path)
    weights = load_weights(resolved.path, config)
    t2 = time.perf_counter()
    tokenizer = Tokenizer.from_folder(resolved.path)
    t3 = time.perf_counter()
    seconds = {"resolve": t1 - t0, **weights.seconds, "tokenizer": t3 - t2}
    model = Model(resolved.name, resolved.path, config, tokenizer, Transformer(config, weights), resolved, seconds)
    if tracer:
        tracer.emit(
            "load", start, t3 - t0, name=resolved.name, source=resolved.source, path=str(resolved.path),
            notes=list(resolved.notes), config=config.summary(), seconds=seconds,
            weights={"parameters": weights.num_parameters, "bytes_loaded": weights.nbytes,
                     "stored": dict(weights.stored_dtypes), "bytes_stored": dict(weights.stored_bytes),
                     "unused": weights.unused_tensors},
            tokenizer={"vocab_size": tokenizer.vocab_size,
                       "special": " ".join(tokenizer.decode([i], skip_special_tokens=False)
                                           for i in sorted(tokenizer.special_token_ids)[:12]),
                       "eos_ids": sorted(tokenizer.eos_token_ids)},
        )
    return model


# --- tokenize ----------------------------------------------------------------------------------
def _as_messages(prompt: Prompt) -> list[dict]:
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def tokenize(model: Model, prompt: Prompt, *, chat: bool | None = None,
             tracer: Tracer | None = None) -> np.ndarray:
    """Turn a prompt into token ids ``[seq]`` int64.

    A ``str`` is encoded as a completion prompt unless ``chat=True``; a list of
    ``{"role", "content"}`` messages always goes through the model's chat template (rendered in a
    jinja2 sandbox, then encoded without adding special tokens, so there is never a second BOS).

    Raises:
        InvalidRequestError: empty prompt. ChatTemplateError: bad messages or no template.
    """
    chat = isinstance(prompt, list) if chat is None else chat
    if (isinstance(prompt, str) and not prompt) or (isinstance(prompt, list) and not prompt):
        raise InvalidRequestError("the prompt is empty; give at least one character (or one message).")
    start = tracer.now() if tracer else 0.0
    t0 = time.perf_counter()
    tok = model.tokenizer
    if chat:
        messages = _as_messages(prompt)
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        messages, text = None, prompt
        ids = tok.encode(text, add_special_tokens=True)
    t1 = time.perf_counter()
    if tracer:
        specials = [tok.decode([i], skip_special_tokens=False) for i in sorted(tok.special_token_ids)]
        tracer.emit("prepare", start, 0.0, chat=chat, messages=messages or [], text=text,
                    special_tokens=[s for s in specials if s])
        tracer.emit("tokenize", start, t1 - t0, ids=ids.tolist(),
                    pieces=[tok.piece_for_display(i) for i in ids.tolist()],
                    special_ids=sorted(tok.special_token_ids))
    return ids


# --- prefill and decode ------------------------------------------------------------------------
def prefill(model: Model, ids: np.ndarray, cache: KVCache, *, tracer: Tracer | None = None,
            params: SamplingParams | None = None) -> np.ndarray:
    """Run the whole prompt through the model in one forward pass; fill the KV cache.

    Args:
        ids: prompt ids ``[seq]``; written to cache positions ``cache.length..+seq``.

    Returns:
        float32 logits ``[vocab]`` for the token after the prompt.

    Raises:
        ContextWindowExceeded: the prompt does not fit in the cache (both numbers and the fix).
    """
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) == 0:
        raise InvalidRequestError("prefill got no tokens; tokenize a non-empty prompt first.")
    if cache.length + len(ids) > cache.max_seq_len:
        raise ContextWindowExceeded(
            f"prompt is {len(ids):,} tokens but the KV cache holds {cache.max_seq_len - cache.length:,} more "
            f"(model context {model.config.max_position_embeddings:,}); shorten the prompt or pass a "
            "larger max_seq_len."
        )
    start = tracer.now() if tracer else 0.0
    t0 = time.perf_counter()
    logits = model.transformer.forward(ids, cache, last_only=True)[0]  # [vocab]
    if tracer:
        dt = time.perf_counter() - t0
        tracer.emit("prefill", start, dt, tokens=len(ids), layers=model.config.num_hidden_layers,
                    cache_length=cache.length,
                    candidates=_candidate_pieces(model, logits, params or SamplingParams(temperature=1.0)))
    return logits


def decode_step(model: Model, token_id: int, cache: KVCache) -> np.ndarray:
    """Feed one token at position ``cache.length``; the cache grows by one.

    Returns:
        float32 logits ``[vocab]`` for the next token.

    Raises:
        KVCacheFullError: no room in the cache for one more position.
    """
    return model.transformer.forward(np.array([token_id], dtype=np.int64), cache)[0]  # [vocab]


def sample(logits: np.ndarray, params: SamplingParams | None = None, rng: np.random.Generator | None = None,
           seen_ids=()) -> int:
    """Choose the next token id from logits ``[vocab]`` (greedy when ``params.temperature == 0``)."""
    return sampling.sample(logits, params or SamplingParams(temperature=0.0), rng, seen_ids=seen_ids)


def detokenize(model: Model, ids, *, skip_special_tokens: bool = True) -> str:
    """Token ids -> text with the model's tokenizer (special tokens hidden by default)."""
    return _detokenize(model.tokenizer, ids, skip_special_tokens=skip_special_tokens)


def _candidate_pieces(model: Model, logits: np.ndarray, params: SamplingParams, seen_ids=()):
    return [(model.tokenizer.piece_for_display(i), p)
            for i, p in sampling.candidates(logits, params, seen_ids=seen_ids, k=5)]


# --- the loop ----------------------------------------------------------------------------------
@dataclass
class GenerationResult:
    """What ``generate`` returns: the new text and ids, why it stopped, and the measurements."""

    text: str
    ids: list[int]  # new token ids (the stopping EOS included, if any)
    prompt_ids: list[int]
    stop_reason: StopReason
    metrics: RequestMetrics


def stream(model: Model, prompt: Prompt, params: SamplingParams | None = None, *,
           max_new_tokens: int = 64, chat: bool | None = None, tracer: Tracer | None = None,
           rng: np.random.Generator | None = None, max_seq_len: int | None = None,
           cache: KVCache | None = None, timeout_s: float | None = None,
           cancel: Callable[[], bool] | None = None, result: list | None = None) -> Iterator[str]:
    """Run one request and yield its text as it is produced (UTF-8 safe deltas).

    The phases in order: tokenize, prefill (first-token logits), then sample / detokenize /
    stop-check / decode_step until a stop condition fires, then free the request state.

    Args:
        params: sampling parameters; default greedy.
        max_new_tokens: budget of new tokens (>= 1).
        chat: apply the chat template to a ``str`` prompt (a message list always is).
        max_seq_len: KV-cache size; default prompt + max_new_tokens, at most the model's context.
        cache: reuse a cache (it is reset first); default a fresh one, freed at the end.
        timeout_s: wall-clock deadline in seconds from the request start.
        cancel: called between steps; returning True cancels the request.
        result: if a list, the :class:`GenerationResult` is appended to it at the end.

    Raises:
        InvalidRequestError: empty prompt, ``max_new_tokens <= 0``.
        ContextWindowExceeded: the prompt alone does not fit in the context.
    """
    if max_new_tokens <= 0:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    params = params or SamplingParams(temperature=0.0)
    rng = rng if rng is not None else np.random.default_rng(params.seed)
    request_t0 = time.perf_counter()
    metrics = RequestMetrics()
    ids = tokenize(model, prompt, chat=chat, tracer=tracer)
    metrics.tokenize_s = time.perf_counter() - request_t0
    metrics.prompt_tokens = len(ids)
    context = model.config.max_position_embeddings
    if len(ids) > context:
        raise ContextWindowExceeded(
            f"prompt is {len(ids):,} tokens but the model holds {context:,}; shorten the prompt.")

    own_cache = cache is None
    if own_cache:
        cache = KVCache.for_model(model.config, max_seq_len or min(context, len(ids) + max_new_tokens))
    else:
        cache.reset()
    stop = StopCriteria(eos_token_ids=model.tokenizer.eos_token_ids, max_new_tokens=max_new_tokens,
                        deadline=None if timeout_s is None else request_t0 + timeout_s, cancel=cancel)
    detok = IncrementalDetokenizer(model.tokenizer)
    new_ids: list[int] = []
    seen = list(ids)
    reason = None
    try:
        t0 = time.perf_counter()
        logits = prefill(model, ids, cache, tracer=tracer, params=params)
        metrics.prefill_s = time.perf_counter() - t0
        step_t0 = t0
        while True:
            token = sample(logits, params, rng, seen_ids=seen)
            now = time.perf_counter()
            if not new_ids:
                metrics.ttft_s = now - request_t0
            else:
                metrics.decode_step_s.append(now - step_t0)
            new_ids.append(token)
            seen.append(token)
            # room left once this token is part of the sequence (it is fed at cache.length)
            reason = stop.check(token, len(new_ids), cache.free_positions - 1)
            if tracer and len(new_ids) > 1:
                _emit_step(model, tracer, step_t0, now, len(new_ids) - 1, cache.length - 1, token,
                           logits, params, seen[:-1], last=reason is not None)
            if reason is not StopReason.EOS:
                delta = detok.add(token)
                if delta:
                    yield delta
            if reason is not None:
                break
            step_t0 = time.perf_counter()
            logits = decode_step(model, token, cache)
        tail = detok.flush()
        if tail:
            yield tail
    finally:
        metrics.total_s = time.perf_counter() - request_t0
        metrics.new_tokens = len(new_ids)
        metrics.kv_bytes_per_token = cache.bytes_per_token
        metrics.kv_bytes_used = cache.used_bytes
        metrics.kv_bytes_reserved = cache.nbytes
        if own_cache:
            cache.free()  # the request's state goes away with the request
    if tracer:
        tracer.emit("stop", tracer.now(), 0.0, reason=reason.value, text=detok.text,
                    detail=_stop_detail(model, reason, new_ids, max_new_tokens))
        tracer.emit("summary", tracer.now(), metrics.total_s, load_s=model.load_s, **metrics.to_dict())
    if result is not None:
        result.append(GenerationResult(detok.text, new_ids, ids.tolist(), reason, metrics))


def _stop_detail(model: Model, reason: StopReason, new_ids: list[int], max_new_tokens: int) -> str:
    if reason is StopReason.EOS:
        piece = model.tokenizer.decode([new_ids[-1]], skip_special_tokens=False)
        return f"token {new_ids[-1]} {piece!r} is in the EOS set {sorted(model.tokenizer.eos_token_ids)}"
    if reason is StopReason.MAX_NEW_TOKENS:
        return f"{len(new_ids)} new tokens = max_new_tokens {max_new_tokens}"
    return ""


def _emit_step(model, tracer, step_t0, now, step, position, token, logits, params, seen, last):
    cands = sampling.candidates(logits, params, seen_ids=seen, k=5)
    prob = dict(cands).get(token, float(sampling.softmax(logits)[token]))
    tracer.emit("decode", step_t0 - tracer.t0, now - step_t0, step=step, position=position, token=token,
                piece=model.tokenizer.piece_for_display(token), prob=prob,
                candidates=[(model.tokenizer.piece_for_display(i), p) for i, p in cands],
                cache_length=position + 1, last=last)


def generate(model: Model, prompt: Prompt, params: SamplingParams | None = None, **kwargs) -> GenerationResult:
    """Run one request to the end; same arguments as :func:`stream`.

    Returns:
        :class:`GenerationResult` with ``text``, new ``ids``, ``stop_reason`` and ``metrics``.
    """
    result: list[GenerationResult] = []
    for _ in stream(model, prompt, params, result=result, **kwargs):
        pass
    return result[0]
