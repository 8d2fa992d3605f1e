"""The request lifecycle, one small function per phase.

    load -> tokenize -> prefill -> sample -> decode_step ... -> detokenize -> stop -> free

``load`` (and the warm-up) live in ``loading.py``; the per-request phases are here.
``generate`` and ``stream`` are these phases in a loop; read them to see the whole request. Each
function takes an optional ``tracer`` (``trace.Tracer``); without one it does no tracing work.
Lifetimes follow llama2.c: a :class:`Model` (weights, tokenizer) lives across requests; a
:class:`~minillm.kv_cache.KVCache` lives for one request and is reset or freed at its end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from . import sampling
from .detokenize import IncrementalDetokenizer
from .detokenize import detokenize as _detokenize
from .errors import ContextWindowExceeded, InvalidRequestError
from .kv_cache import KVCache
from .metrics import RequestMetrics, cpu_snapshot, others_cpu_share
from .sampling import SamplingParams
from .stopping import (OutputStream, StopCriteria, StopReason, cancel_check, describe_stop, validate_stop_strings,
                       validate_stop_token_ids)
from .config import SLIDING
from .diagnosis import diagnose
from .loading import Model, blas_threads, load, run_warmup  # noqa: F401  (load is the lifecycle's first phase)
from .metrics import kv_memory_table, weight_memory_table
from .trace import Tracer

Prompt = str | list[dict]


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
        tracer.emit("prepare", start, 0.0, chat=chat, messages=messages or [], text=text,
                    special_tokens=[s for s in tok.special_token_texts if s])
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
        sliding = model.transformer.layer_types.count(SLIDING)
        tracer.emit("prefill", start, dt, tokens=len(ids), layers=model.config.num_hidden_layers,
                    offset=cache.length - len(ids), cache_length=cache.length,
                    sliding_window=model.config.sliding_window if sliding else None, sliding_layers=sliding,
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
    return _as_pieces(model, sampling.candidates(logits, params, seen_ids=seen_ids, k=5))


def _as_pieces(model: Model, candidates: list[tuple[int, float]]) -> list[tuple[str, float]]:
    """``[(token id, probability)]`` -> ``[(piece as displayed, probability)]`` for the trace."""
    return [(model.tokenizer.piece_for_display(i), p) for i, p in candidates]


# --- the loop ----------------------------------------------------------------------------------
@dataclass
class GenerationResult:
    """What ``generate`` returns: the new text and ids, why it stopped, and the measurements."""

    text: str  # what the user sees: no EOS text, no stop string (unless asked), no half characters
    ids: list[int]  # every new token id, the stopping EOS / stop sequence included
    prompt_ids: list[int]
    stop_reason: StopReason
    metrics: RequestMetrics
    stop_condition: object = None  # which condition fired: the stop string, the id sequence, ...


def _check_window(model: Model, n_prompt: int, window: int, by_cache: bool) -> None:
    """The prompt must leave room for at least one new token (prompt + new <= window)."""
    if n_prompt < window:
        return
    fix = "shorten the prompt" if not by_cache else \
        f"shorten the prompt or pass a larger max_seq_len (the model holds {model.config.max_position_embeddings:,})"
    raise ContextWindowExceeded(
        f"prompt is {n_prompt:,} tokens but the {'KV cache' if by_cache else 'model'} holds "
        f"{window:,} positions, which leaves no room for a new token; {fix} to at most {window - 1:,} tokens.")


def stream(model: Model, prompt: Prompt, params: SamplingParams | None = None, *,
           max_new_tokens: int = 64, chat: bool | None = None, tracer: Tracer | None = None,
           rng: np.random.Generator | None = None, max_seq_len: int | None = None,
           cache: KVCache | None = None, stop: list[str] | str | None = None,
           stop_token_ids: list[list[int]] | None = None, include_stop_string: bool = False,
           timeout_s: float | None = None, cancel=None, result: list | None = None) -> Iterator[str]:
    """Run one request and yield its text as it is produced (UTF-8 safe deltas).

    The phases in order: tokenize, prefill (first-token logits), then sample / detokenize /
    stop-check / decode_step until a stop condition fires, then free the request state.

    Args:
        params: sampling parameters; default greedy. The repetition penalty counts the prompt's
            ids as seen, as transformers does.
        max_new_tokens: budget of new tokens (>= 1).
        chat: apply the chat template to a ``str`` prompt (a message list always is).
        max_seq_len: KV-cache size in positions; default prompt + max_new_tokens, at most the
            model's context. Prompt + new tokens never exceed it: at the edge the request stops
            with ``CONTEXT_FULL`` (no exception).
        cache: reuse a cache (reset before and after the request); default a fresh one, freed
            at the end.
        stop: stop strings, found in the text across token boundaries; the text is cut before
            the earliest match (held back while streaming, so it never leaks). They are matched
            in the shown text, where special tokens are hidden: stop on those with stop_token_ids.
        stop_token_ids: stop-token sequences, e.g. ``[[2], [28, 29]]``, found in the new ids.
        include_stop_string: keep the matched stop string (or sequence's text) in the output.
        timeout_s: wall-clock deadline in seconds from the request start (> 0).
        cancel: a ``threading.Event`` or a callable returning True; checked between steps.
            A ``KeyboardInterrupt`` (Ctrl-C) during the model's work cancels the same way.
        result: if a list, the :class:`GenerationResult` is appended to it at the end.

    Raises:
        InvalidRequestError: empty prompt, ``max_new_tokens <= 0``, an empty stop string or
            sequence, ``timeout_s <= 0``, a ``cancel`` that is neither Event nor callable.
        ContextWindowExceeded: the prompt leaves no room for a new token (before prefill).
    """
    if max_new_tokens <= 0:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise InvalidRequestError(f"timeout_s must be a number of seconds > 0 (or None), got {timeout_s!r}.")
    stop_strings, stop_seqs = validate_stop_strings(stop), validate_stop_token_ids(stop_token_ids)
    cancelled = cancel_check(cancel)
    params = params or SamplingParams(temperature=0.0)
    rng = rng if rng is not None else np.random.default_rng(params.seed)
    request_t0 = time.perf_counter()
    cpu_at_start = cpu_snapshot()
    metrics = RequestMetrics()
    is_chat = isinstance(prompt, list) if chat is None else chat
    ids = tokenize(model, prompt, chat=chat, tracer=tracer)
    metrics.tokenize_s = time.perf_counter() - request_t0
    metrics.prompt_tokens = len(ids)
    context = model.config.max_position_embeddings
    if cache is not None:
        _check_window(model, len(ids), cache.max_seq_len, by_cache=True)
    elif max_seq_len is not None and max_seq_len < context:
        _check_window(model, len(ids), max_seq_len, by_cache=True)
    else:
        _check_window(model, len(ids), context, by_cache=False)

    own_cache = cache is None
    if own_cache:
        cache = KVCache.for_model(model.config, max_seq_len or min(context, len(ids) + max_new_tokens))
    else:
        cache.reset()
    criteria = StopCriteria(eos_token_ids=model.tokenizer.eos_token_ids, max_new_tokens=max_new_tokens,
                            deadline=None if timeout_s is None else request_t0 + timeout_s, cancel=cancelled)
    # A completion continues the prompt's text: decode with its last tokens as context, so a
    # first token like '▁Paris' keeps its space. A chat answer is a fresh text: no context.
    detok = IncrementalDetokenizer(model.tokenizer, prompt_ids=None if is_chat else ids)
    out = OutputStream(detok, stop=stop_strings, stop_token_ids=stop_seqs, include_stop_string=include_stop_string)
    new_ids: list[int] = []
    seen = list(ids)  # the repetition penalty's "seen" set: prompt + new ids
    reason, condition = None, None
    logits, token = None, None
    try:
        reason = criteria.interrupted()  # cancelled or already past the deadline: no work at all
        while reason is None:
            step_t0 = time.perf_counter()
            try:  # Ctrl-C during the model's work ends the request cleanly, as a cancel
                if logits is None:
                    logits = prefill(model, ids, cache, tracer=tracer, params=params)
                    metrics.prefill_s = time.perf_counter() - step_t0
                else:
                    logits = decode_step(model, token, cache)
                token = sample(logits, params, rng, seen_ids=seen)
            except KeyboardInterrupt:
                reason, condition = StopReason.CANCELLED, "KeyboardInterrupt (Ctrl-C)"
                break
            now = time.perf_counter()
            if not new_ids:
                metrics.ttft_s = now - request_t0
            else:
                metrics.decode_step_s.append(now - step_t0)
            new_ids.append(token)
            seen.append(token)
            # room left once this token is part of the sequence (it would be fed at cache.length)
            reason = criteria.check(token, len(new_ids), cache.free_positions - 1)
            delta = ""
            if reason is not StopReason.EOS:  # an EOS id ends the text; it is never shown
                delta = out.add(token)
                reason = out.stop_reason or reason
            if tracer and len(new_ids) > 1:
                _emit_step(model, tracer, step_t0, now, len(new_ids) - 1, cache.length - 1, token,
                           logits, params, seen[:-1], last=reason is not None, delta=delta)
            if delta:
                if tracer:
                    tracer.stream_text(delta)
                yield delta
            if reason is None:
                reason = criteria.interrupted()  # between steps: before the next forward pass
        tail = out.finish()  # held text is released (a stop string found here still cuts it)
        reason = out.stop_reason or reason
        if tail:
            if tracer:
                tracer.stream_text(tail)
            yield tail
    except GeneratorExit:  # the caller stopped reading: that is a cancel too
        if reason is None:
            reason, condition = StopReason.CANCELLED, "the caller closed the stream"
    finally:
        metrics.total_s = time.perf_counter() - request_t0
        metrics.new_tokens = len(new_ids)
        metrics.kv_bytes_per_token = cache.bytes_per_token
        metrics.kv_bytes_used = cache.used_bytes
        metrics.kv_bytes_reserved = cache.nbytes
        metrics.others_cpu_share = others_cpu_share(cpu_at_start, cpu_snapshot())
        # The request's state goes away with the request: a cache we made is freed, a cache we
        # were given is emptied for the next request (its memory stays allocated).
        window = cache.max_seq_len
        if own_cache:
            cache.free()
        else:
            cache.reset()
    if out.stop_reason is not None:
        condition = out.condition
    elif reason is StopReason.CANCELLED and condition is None:
        condition = "cancel was set"
    elif reason is StopReason.TIMEOUT:
        condition = timeout_s
    elif reason is StopReason.EOS:
        condition = new_ids[-1]
    if tracer:
        tracer.emit("stop", tracer.now(), 0.0, reason=reason.value, condition=condition, text=out.text,
                    detail=describe_stop(
                        reason, condition, n_new=len(new_ids), max_new_tokens=max_new_tokens, n_prompt=len(ids),
                        window=window, elapsed_s=metrics.total_s, include=include_stop_string,
                        eos_ids=sorted(model.tokenizer.eos_token_ids),
                        eos_text=model.tokenizer.decode([condition], skip_special_tokens=False)
                        if reason is StopReason.EOS else ""))
        _emit_summary(model, tracer, metrics, out.text)
    model.requests_served += 1
    if result is not None:
        result.append(GenerationResult(out.text, new_ids, ids.tolist(), reason, metrics, condition))


def _emit_summary(model: Model, tracer: Tracer, metrics: RequestMetrics, text: str) -> None:
    diagnosis = diagnose(metrics, load_s=model.load_s, warmup_s=model.warmup_s,
                         first_request=model.requests_served == 0, text=text,
                         special_tokens=model.tokenizer.special_token_texts,
                         load_source=model.resolved.source if model.resolved else None, blas_threads=blas_threads())
    params = model.transformer.weights.num_parameters
    tracer.emit("summary", tracer.now(), metrics.total_s, load_s=model.load_s, warmup_s=model.warmup_s,
                **metrics.to_dict(), parameters=params,
                weight_bytes=weight_memory_table(params), kv_bytes=kv_memory_table(model.config),
                context=model.config.max_position_embeddings,
                diagnosis={"dominant": diagnosis.dominant, "phase_seconds": diagnosis.phase_seconds,
                           "findings": diagnosis.findings})


def _emit_step(model, tracer, step_t0, now, step, position, token, logits, params, seen, last, delta=""):
    cands = sampling.candidates(logits, params, seen_ids=seen, k=5)
    prob = dict(cands).get(token, float(sampling.softmax(logits)[token]))
    fed = seen[-1]  # the token this step fed in, at `position`
    tracer.emit("decode", step_t0 - tracer.t0, now - step_t0, step=step, position=position,
                input_token=fed, input_piece=model.tokenizer.piece_for_display(fed), token=token,
                piece=model.tokenizer.piece_for_display(token), prob=prob,
                candidates=_as_pieces(model, cands),
                cache_length=position + 1, last=last, text=delta)


def generate(model: Model, prompt: Prompt, params: SamplingParams | None = None, **kwargs) -> GenerationResult:
    """Run one request to the end; same arguments as :func:`stream`.

    Returns:
        :class:`GenerationResult` with ``text``, new ``ids``, ``stop_reason``, ``stop_condition``
        and ``metrics``.
    """
    result: list[GenerationResult] = []
    for _ in stream(model, prompt, params, result=result, **kwargs):
        pass
    return result[0]
