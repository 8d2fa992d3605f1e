"""One request's state, from its validated arguments to its result (vLLM's ``Request``; llama2.c's
run state): the prompt ids, the KV cache, the sampler's generator, the stop chain and the
measurements. ``generate.stream`` drives it; it lives exactly as long as the request.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from minillm.errors import ContextWindowExceeded, InvalidRequestError
from minillm.model.kv_cache import KV_DTYPES, KVCache
from minillm.runtime import sampling, steps
from minillm.runtime.loading import Model
from minillm.runtime.sampling import SamplingParams
from minillm.runtime.stopping import StopCriteria, StopReason, StopSequenceMatcher, StopStringMatcher, cancel_check
from minillm.text.detokenize import IncrementalDetokenizer


@dataclass
class RequestMetrics:
    """Measured times (seconds) and sizes (tokens, bytes) of one request.

    TTFT: request start (before tokenization) -> first new token sampled. TPOT: the wall time of
    each decode step (one forward over one position plus sampling). Prefill tokens/s = prompt
    tokens / prefill seconds; decode tokens/s = 1 / mean TPOT.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    tokenize_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_step_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    kv_dtype: str = "float32"  # how the KV cache held its entries (KVCache dtype)
    kv_bytes_per_token: int = 0
    kv_bytes_used: int = 0
    kv_bytes_reserved: int = 0
    cached_prompt_tokens: int = 0  # prompt positions reused from a paged pool's prefix cache (batching)
    preemptions: int = 0  # times the batch scheduler took this request's blocks back to recompute later
    prompt_tokens_computed: int = 0  # prompt positions the batch scheduler fed (cache hits not; recomputed again)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def tpot_s(self) -> float:
        """Mean decode step time in seconds (NaN when there was no decode step)."""
        return float(np.mean(self.decode_step_s)) if self.decode_step_s else float("nan")

    def tpot_percentile(self, q: float) -> float:
        """The ``q``-th percentile of the decode step times, seconds (NaN without decode steps)."""
        return float(np.percentile(self.decode_step_s, q)) if self.decode_step_s else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.tpot_s if self.decode_step_s else float("nan")

    def rates(self) -> dict:
        """The per-token rates ``Model.history`` keeps: prompt tokens, TTFT seconds per prompt token
        (NaN without a first token), mean TPOT seconds (NaN without decode steps)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            # NaN when no first token came (cancelled or timed out before it): nothing was measured
            "prefill_s_per_token": self.ttft_s / max(self.prompt_tokens, 1) if self.ttft_s > 0 else float("nan"),
            "tpot_s": self.tpot_s,
        }

    def to_dict(self) -> dict:
        """Every field and derived rate, as plain data."""
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}
        d["decode_step_s"] = list(self.decode_step_s)
        d.update(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            tpot_s=self.tpot_s,
            tpot_p50_s=self.tpot_percentile(50),
            tpot_p90_s=self.tpot_percentile(90),
            decode_tokens_per_s=self.decode_tokens_per_s,
        )
        return d


@dataclass
class GenerationResult:
    """What ``generate`` returns: the new text and ids, why it stopped, and the measurements."""

    text: str  # what the user sees: no EOS text, no stop string (unless asked), no half characters
    ids: list[int]  # every new token id, the stopping EOS / stop sequence included
    prompt_ids: list[int]
    stop_reason: StopReason
    metrics: RequestMetrics
    stop_condition: object = None  # which condition fired: the stop string, the id sequence, ...


class OutputStream:
    """Generated ids in, text a user may see out, for one request.

        id -> StopSequenceMatcher (hold) -> IncrementalDetokenizer -> StopStringMatcher (hold) -> delta

    Args:
        detokenizer: an :class:`~minillm.text.detokenize.IncrementalDetokenizer` (``add(id) -> str``,
            ``flush() -> str``); may be set after construction, before the first :meth:`add`.
        stop: stop strings; ``stop_token_ids``: id sequences.
        include_stop_string: show the matched stop string (or the stop sequence's text).

    After :meth:`add` or :meth:`finish`, ``stop_reason`` is ``STOP_STRING`` / ``STOP_SEQUENCE``
    once one fired, and ``condition`` names it (the string, or the id list).
    """

    def __init__(self, detokenizer, *, stop: Iterable[str] = (), stop_token_ids=(), include_stop_string: bool = False):
        self.detokenizer = detokenizer
        self.strings = StopStringMatcher(stop, include_stop_string=include_stop_string)
        self.sequences = StopSequenceMatcher(stop_token_ids or [], include=include_stop_string)
        self.stop_reason: StopReason | None = None
        self.condition: str | list[int] | None = None

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self.strings.text

    def _to_text(self, ids: list[int], final: bool = False) -> str:
        pieces = "".join(self.detokenizer.add(i) for i in ids)
        if final:
            pieces += self.detokenizer.flush()
        delta = self.strings.push(pieces)
        if self.strings.matched is not None and self.stop_reason is None:
            self.stop_reason, self.condition = StopReason.STOP_STRING, self.strings.matched
        return delta

    def add(self, token_id: int) -> str:
        """Feed one generated id (not an EOS); return the text delta it releases (often "")."""
        if self.stop_reason is not None:
            return ""
        delta = self._to_text(self.sequences.push(token_id))
        if self.sequences.matched is not None and self.stop_reason is None:
            self.stop_reason, self.condition = StopReason.STOP_SEQUENCE, list(self.sequences.matched)
            delta += self._to_text([], final=True)
        return delta

    def finish(self) -> str:
        """End of the request: release held ids and text (a held stop-string prefix included)."""
        delta = self._to_text(self.sequences.flush(), final=True) if self.stop_reason is None else ""
        return delta + (self.strings.flush() if self.strings.matched is None else "")


class Request:
    """One request's state while it runs; ``generate.stream`` drives it.

    Built from the request's arguments (validated here, before any model work), it renders and
    tokenizes the prompt, checks the window, owns the KV cache, the sampler's generator and the
    stop chain, measures the phases, and tells a listener (``listener.on_event``, e.g. a
    ``Tracer``) what happened. With no listener, it computes nothing for one.

    Args:
        listener: told each phase (``on_event``); None computes nothing for one.
        params: sampling parameters; default greedy. The repetition penalty counts the prompt's
            ids as seen, as transformers does.
        max_new_tokens: budget of new tokens (>= 1).
        chat: apply the chat template to a ``str`` prompt (a message list always is).
        max_seq_len: KV-cache size in positions; default prompt + max_new_tokens, at most the
            model's context. Prompt + new tokens never exceed it: at the edge the request stops
            with ``CONTEXT_FULL`` (no exception).
        cache: reuse a cache (reset before and after the request); default a fresh one, freed
            at the end.
        kv_dtype: how a fresh cache holds keys and values: ``"float32"`` (default), ``"float16"``
            or ``"int8"`` (+ a float32 scale per position and head; ``KVCache``). With ``cache``,
            None or the cache's own dtype.
        stop: stop strings, found in the text across token boundaries; the text is cut before
            the earliest match (held back while streaming, so it never leaks). They are matched
            in the shown text, where special tokens are hidden: stop on those with stop_token_ids.
        stop_token_ids: stop-token sequences, e.g. ``[[2], [28, 29]]``, found in the new ids.
        include_stop_string: keep the matched stop string (or sequence's text) in the output.
        timeout_s: wall-clock deadline in seconds from the request start (> 0).
        cancel: a ``threading.Event`` or a callable returning True; checked between steps.
            A ``KeyboardInterrupt`` (Ctrl-C) during the model's work cancels the same way.

    Raises (on construction):
        InvalidRequestError: empty prompt, ``max_new_tokens <= 0``, an empty stop string or
            sequence, ``timeout_s <= 0``, a ``cancel`` that is neither Event nor callable, a
            ``kv_dtype`` not in ``KV_DTYPES`` or not the given cache's.
        ContextWindowExceeded: the prompt leaves no room for a new token.
    """

    #: the keyword options a request takes (``generate.stream`` passes them through)
    OPTIONS = frozenset(
        {
            "max_new_tokens",
            "chat",
            "rng",
            "max_seq_len",
            "cache",
            "kv_dtype",
            "stop",
            "stop_token_ids",
            "include_stop_string",
            "timeout_s",
            "cancel",
        }
    )

    def __init__(
        self,
        model: Model,
        prompt: steps.Prompt,
        params: SamplingParams | None = None,
        *,
        max_new_tokens: int = 64,
        chat: bool | None = None,
        listener=None,
        rng: np.random.Generator | None = None,
        max_seq_len: int | None = None,
        cache: KVCache | None = None,
        kv_dtype: str | None = None,
        stop: list[str] | str | None = None,
        stop_token_ids: list[list[int]] | None = None,
        include_stop_string: bool = False,
        timeout_s: float | None = None,
        cancel=None,
    ):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise InvalidRequestError(
                f"max_new_tokens must be >= 1, got {max_new_tokens!r} (a whole number of tokens)."
            )
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
            raise InvalidRequestError(f"timeout_s must be a number of seconds > 0 (or None), got {timeout_s!r}.")
        self.kv_dtype = check_kv_dtype(kv_dtype, cache)
        self.model, self.listener, self.max_new_tokens = model, listener, max_new_tokens
        self.include_stop_string, self.timeout_s = include_stop_string, timeout_s
        # The stop chain validates the stop arguments, before any model work.
        self.output = OutputStream(
            None, stop=stop, stop_token_ids=stop_token_ids, include_stop_string=include_stop_string
        )
        is_cancelled = cancel_check(cancel)
        self.params = params or sampling.GREEDY
        self.rng = rng if rng is not None else np.random.default_rng(self.params.seed)
        self.t0 = time.perf_counter()
        self.metrics = RequestMetrics()
        chat = steps.is_chat(prompt, chat)
        text = steps.prompt_text(model, prompt, chat=chat)
        self.prompt_ids = model.tokenizer.encode(text, add_special_tokens=not chat)  # [seq] int64
        self.metrics.tokenize_s = time.perf_counter() - self.t0
        self.metrics.prompt_tokens = len(self.prompt_ids)
        self._emit(
            "prepare",
            self.t0,
            0.0,
            chat=chat,
            messages=prompt if isinstance(prompt, list) else ([{"role": "user", "content": prompt}] if chat else []),
            text=text,
        )
        self._emit("tokenize", self.t0, self.metrics.tokenize_s, ids=self.prompt_ids)

        context = model.config.max_position_embeddings
        self.own_cache = cache is None
        window = cache.max_seq_len if cache is not None else min(max_seq_len or context, context)
        check_window(len(self.prompt_ids), window, context, by_cache=cache is not None or window < context)
        if self.own_cache:
            cache = self.new_cache(max_seq_len or min(context, len(self.prompt_ids) + max_new_tokens))
        else:
            cache.reset()
        self.cache = cache
        self.window = cache.max_seq_len
        self.criteria = StopCriteria(
            eos_token_ids=model.tokenizer.eos_token_ids,
            max_new_tokens=max_new_tokens,
            deadline=None if timeout_s is None else self.t0 + timeout_s,
            cancel=is_cancelled,
        )
        # A completion continues the prompt's text: decode with its last tokens as context, so a
        # first token like '▁Paris' keeps its space. A chat answer is a fresh text: no context.
        self.output.detokenizer = IncrementalDetokenizer(model.tokenizer, prompt_ids=None if chat else self.prompt_ids)
        self.new_ids: list[int] = []
        self.seen = list(self.prompt_ids)  # the repetition penalty's "seen" ids: prompt + new ids
        self.stop_reason: StopReason | None = None
        self.condition = None

    def new_cache(self, max_seq_len: int) -> KVCache:
        """The request's own cache of ``max_seq_len`` positions: a contiguous :class:`KVCache` here;
        a batched request takes a sequence of the shared paged pool instead (``scheduler.py``)."""
        return KVCache.for_model(self.model.config, max_seq_len, dtype=self.kv_dtype)

    def _emit(self, phase: str, start: float, duration: float, **facts) -> None:
        if self.listener is not None:
            self.listener.on_event(phase, start, duration, self.model, facts)

    def running(self) -> bool:
        """True while no stop condition has fired; checks cancel and the deadline *between* steps,
        so a stop costs no further forward pass."""
        if self.stop_reason is None:
            self.stop_reason = self.criteria.interrupted()
        return self.stop_reason is None

    def take(self, logits: np.ndarray, step_t0: float):
        """Sample the next token from ``logits`` ``[vocab]`` and pass it through the stop chain;
        yield the text it releases (often nothing). ``step_t0``: when this step's forward began."""
        if self.listener is None:
            token, probs = sampling.sample(logits, self.params, self.rng, seen_ids=self.seen), None
        else:  # the trace shows the distribution the token was drawn from
            token, probs = sampling.sample_with_probs(logits, self.params, self.rng, seen_ids=self.seen)
        now = time.perf_counter()
        if not self.new_ids:
            self.metrics.ttft_s = now - self.t0
        else:
            self.metrics.decode_step_s.append(now - step_t0)
        fed = self.seen[-1]  # the token this step fed in (the last prompt token for prefill)
        self.new_ids.append(token)
        self.seen.append(token)
        # room left once this token is part of the sequence (it would be fed at cache.length)
        reason = self.criteria.check(token, len(self.new_ids), self.cache.free_positions - 1)
        delta = ""
        if reason is not StopReason.EOS:  # an EOS id ends the text; it is never shown
            delta = self.output.add(token)
            reason = self.output.stop_reason or reason
        self.stop_reason = reason
        if len(self.new_ids) == 1:
            n = len(self.prompt_ids)
            self._emit(
                "prefill",
                step_t0,
                self.metrics.prefill_s,
                tokens=n,
                offset=self.cache.length - n,
                cache_length=self.cache.length,
                probs=probs,
                token=token,
            )
        else:
            self._emit(
                "decode",
                step_t0,
                now - step_t0,
                step=len(self.new_ids) - 1,
                position=self.cache.length - 1,
                input_token=fed,
                token=token,
                probs=probs,
                cache_length=self.cache.length,
                last=reason is not None,
                text=delta,
            )
        yield from self._show(delta)

    def _show(self, delta: str):
        if delta:
            self._emit("text", time.perf_counter(), 0.0, text=delta)
            yield delta

    def flush(self):
        """Yield the text still held at the end (a stop-string prefix that never completed)."""
        tail = self.output.finish()  # a stop string found here still cuts it
        self.stop_reason = self.output.stop_reason or self.stop_reason
        yield from self._show(tail)

    def cancel(self, why: str) -> None:
        """End the request as cancelled (Ctrl-C, a closed stream), unless it already stopped."""
        if self.stop_reason is None:
            self.stop_reason, self.condition = StopReason.CANCELLED, why

    def release(self) -> None:
        """Measure the totals and free the request's state: a cache it made is freed, a cache it
        was given is emptied for the next request (its memory stays allocated)."""
        m = self.metrics
        m.total_s = time.perf_counter() - self.t0
        m.new_tokens = len(self.new_ids)
        m.kv_dtype = getattr(self.cache, "dtype", "float32")  # a paged sequence holds float32
        m.kv_bytes_per_token, m.kv_bytes_used, m.kv_bytes_reserved = (
            self.cache.bytes_per_token,
            self.cache.used_bytes,
            self.cache.nbytes,
        )
        if self.own_cache:
            self.cache.free()
        else:
            self.cache.reset()

    def finish(self) -> GenerationResult:
        """Name the condition that fired, tell the listener (stop, summary), return the result."""
        reason = self.stop_reason
        if self.output.stop_reason is not None:
            self.condition = self.output.condition
        elif reason is StopReason.CANCELLED and self.condition is None:
            self.condition = "the cancel event was set"
        elif reason is StopReason.TIMEOUT:
            self.condition = self.timeout_s
        elif reason is StopReason.EOS:
            self.condition = self.new_ids[-1]
        model = self.model
        now = time.perf_counter()
        self._emit(
            "stop",
            now,
            0.0,
            reason=reason,
            condition=self.condition,
            text=self.output.text,
            n_new=len(self.new_ids),
            max_new_tokens=self.max_new_tokens,
            n_prompt=len(self.prompt_ids),
            window=self.window,
            elapsed_s=self.metrics.total_s,
            include=self.include_stop_string,
            ends_inside_character=bool(getattr(self.output.detokenizer, "ends_inside_character", False)),
        )
        self._emit(
            "summary",
            now,
            self.metrics.total_s,
            metrics=self.metrics,
            text=self.output.text,
            first_request=model.requests_served == 0,
        )
        model.requests_served += 1
        model.history.append(self.metrics.rates())
        return GenerationResult(
            self.output.text, self.new_ids, self.prompt_ids.tolist(), reason, self.metrics, self.condition
        )


def check_window(n_prompt: int, window: int, context: int, by_cache: bool) -> None:
    """The prompt must leave room for at least one new token: ``n_prompt < window``.

    Raises:
        ContextWindowExceeded: with both numbers and the fix.
    """
    if n_prompt < window:
        return
    fix = (
        "shorten the prompt"
        if not by_cache
        else f"shorten the prompt or pass a larger max_seq_len (the model holds {context:,})"
    )
    raise ContextWindowExceeded(
        f"prompt is {n_prompt:,} tokens but the {'KV cache' if by_cache else 'model'} holds "
        f"{window:,} positions, which leaves no room for a new token; {fix} to at most {window - 1:,} tokens."
    )


def check_kv_dtype(kv_dtype: str | None, cache: KVCache | None) -> str:
    """The KV dtype a request uses: ``kv_dtype``, else the given cache's, else ``"float32"``.

    Raises:
        InvalidRequestError: a dtype not in ``KV_DTYPES`` (naming the choices), or one that is not
            the given cache's own.
    """
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise InvalidRequestError(
            f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r} (float16 halves the KV cache, "
            "int8 stores a quarter plus a float32 scale per position and head)."
        )
    have = getattr(cache, "dtype", None) if cache is not None else None
    if kv_dtype is not None and have is not None and kv_dtype != have:
        raise InvalidRequestError(
            f"kv_dtype={kv_dtype!r} but the cache passed holds {have}; pass kv_dtype={have!r} (or none), or a "
            f"cache made with KVCache.for_model(config, dtype={kv_dtype!r})."
        )
    return kv_dtype or have or "float32"
