"""One request's state, from its validated arguments to its result (vLLM's ``Request``; llama2.c's
run state): the prompt ids, the KV cache, the sampler's generator, the stop chain and the
measurements. ``generate.stream`` drives it; it lives exactly as long as the request.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from minillm.model.kernels import PLAIN
from minillm.model.kv_cache import KVCache
from minillm.runtime import constraint as constraint_module
from minillm.runtime import sampling, steps
from minillm.runtime.loading import Model
from minillm.runtime.request_checks import check_arguments, check_kv_dtype, check_logit_bias, check_window
from minillm.runtime.result import GenerationResult, RequestMetrics  # noqa: F401 (re-exported)
from minillm.runtime.sampling import SamplingParams
from minillm.runtime.speculative import Speculative, SpeculativeDecoder
from minillm.runtime.steps import shared_prefix
from minillm.runtime.stopping import (
    OutputStream,
    StopCriteria,
    StopReason,
    cancel_check,
    validate_stop_strings,
    validate_stop_token_ids,
)
from minillm.text.detokenize import IncrementalDetokenizer


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
            at the end. (``Conversation`` turns keep the prefix it shares with the prompt.)
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
        constraint: what the output must match (``constraint.py``): a dict (a JSON schema) or a
            ``Constraint`` (``json_schema``, ``json_object``, ``regex``, ``lark``); None: free text.
        speculative: a :class:`~minillm.runtime.speculative.Speculative` or a draft name: decode by
            drafting and verifying (``speculative.py``); None decodes one token per pass.
        prepared: ``(text, ids, seconds)`` when the caller already rendered and tokenized this very
            prompt (the server does, to size the request): the text the model reads, its ids
            ``[seq]`` int64 and the seconds that took; the prompt is then not tokenized again.
        new_cache: ``positions -> cache``, how the request makes its own cache when none is given;
            default a contiguous :class:`KVCache` at ``kv_dtype`` (a batched request takes a sequence
            of the shared paged pool, ``scheduler.BatchRequest``).
        cached_ids: with ``cache``, the ids of its positions ``0..`` (a conversation's earlier turns):
            the request keeps the prefix its prompt shares with them and leaves what it wrote in the
            cache when it ends; None: the given cache is emptied before and after.

    Raises (on construction):
        InvalidRequestError: empty prompt, ``max_new_tokens <= 0``, an empty stop string or
            sequence, ``timeout_s <= 0``, a ``cancel`` that is neither Event nor callable, a
            ``kv_dtype`` not in ``KV_DTYPES`` or not the given cache's, a bad ``speculative``.
        ContextWindowExceeded: the prompt leaves no room for a new token.
    """

    #: the keyword options a request takes (``generate.stream`` passes them through)
    OPTIONS = frozenset(
        "max_new_tokens chat rng max_seq_len cache kv_dtype stop stop_token_ids include_stop_string timeout_s "
        "cancel constraint speculative".split()
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
        constraint=None,
        speculative=None,
        prepared: tuple[str, np.ndarray, float] | None = None,
        new_cache: Callable[[int], KVCache] | None = None,
        cached_ids: list[int] | None = None,
    ):
        spec = Speculative.of(speculative)  # checked before any model work
        check_arguments(max_new_tokens, timeout_s)
        self.kv_dtype = check_kv_dtype(kv_dtype, cache)
        self.model, self.listener, self.max_new_tokens = model, listener, max_new_tokens
        self.include_stop_string, self.timeout_s = include_stop_string, timeout_s
        # The stop chain's arguments are checked before any model work; the chain is built below.
        stop_options = dict(
            stop=validate_stop_strings(stop),
            stop_token_ids=validate_stop_token_ids(stop_token_ids),
            include_stop_string=include_stop_string,
        )
        is_cancelled = cancel_check(cancel)
        self.params = params or sampling.GREEDY
        check_logit_bias(model, self.params)
        self.logprobs: list[dict] | None = None if self.params.top_logprobs is None else []
        self.constraint = None if constraint is None else constraint_module.ConstraintState(model, constraint)
        self.queued: list[int] = []  # with logprobs: the rest of a forced run, taken one a step (take)
        self.rng = rng if rng is not None else np.random.default_rng(self.params.seed)
        self.t0 = time.perf_counter()
        self.metrics = RequestMetrics()
        chat = steps.is_chat(prompt, chat)
        self.prompt_ids = self._tokenize(prompt, chat, prepared)  # [seq] int64
        self.keeps_cache = cached_ids is not None  # a conversation's turn: what it wrote stays for the next
        self.cache = self._open_cache(cache, max_seq_len, max_new_tokens, new_cache, cached_ids)
        self.reused = self.metrics.cached_prompt_tokens = self.cache.length  # prefill feeds the prompt ids past these
        self.window = self.cache.max_seq_len
        self.criteria = StopCriteria(
            eos_token_ids=model.tokenizer.eos_token_ids,
            max_new_tokens=max_new_tokens,
            deadline=None if timeout_s is None else self.t0 + timeout_s,
            cancel=is_cancelled,
        )
        # A completion continues the prompt's text: decode with its last tokens as context, so a
        # first token like '▁Paris' keeps its space. A chat answer is a fresh text: no context.
        detokenizer = IncrementalDetokenizer(model.tokenizer, prompt_ids=None if chat else self.prompt_ids)
        self.output = OutputStream(detokenizer, **stop_options)
        self.new_ids: list[int] = []
        self.seen = list(self.prompt_ids)  # the repetition penalty's "seen" ids: prompt + new ids
        self.stop_reason: StopReason | None = None
        self.condition = None
        # speculative decoding's draft and adaptive k; the step between the two is speculative_step.py
        self.drafter = None if spec is None else SpeculativeDecoder(spec, model, self.window)
        self.metrics.speculative_k = 0 if spec is None else spec.num_tokens

    def _tokenize(self, prompt: steps.Prompt, chat: bool, prepared) -> np.ndarray:
        """Render (a chat) and tokenize the prompt, ``int64 [seq]``, unless the caller did already
        (``prepared``: the text, its ids and the seconds it took; the server's worker sizes the
        request by them); tell the listener both phases."""
        if prepared is None:
            prepared = steps.prepare(self.model, prompt, chat=chat)
        text, ids, self.metrics.tokenize_s = prepared
        self.metrics.prompt_tokens = len(ids)
        messages = prompt if isinstance(prompt, list) else ([{"role": "user", "content": prompt}] if chat else [])
        self.emit("prepare", self.t0, 0.0, chat=chat, messages=messages, text=text)
        self.emit("tokenize", self.t0, self.metrics.tokenize_s, ids=ids)
        return ids

    def _open_cache(self, cache, max_seq_len, max_new_tokens: int, new_cache, cached_ids) -> KVCache:
        """The request's cache, after checking the prompt fits its window: a fresh one (``new_cache``), or
        the given one emptied but for the prefix the prompt shares with ``cached_ids`` (a conversation's
        earlier turns; at least one prompt id is fed, its logits choose the first new token). Raises
        ContextWindowExceeded."""
        context, n_prompt = self.model.config.max_position_embeddings, len(self.prompt_ids)
        self.own_cache = cache is None
        window = cache.max_seq_len if cache is not None else min(max_seq_len or context, context)
        check_window(n_prompt, window, context, by_cache=cache is not None or window < context)
        if self.own_cache:
            positions = max_seq_len or min(context, n_prompt + max_new_tokens)
            if new_cache is None:
                # built as the model's kernels say: the textbook's KVCache, or a student's (the exercises)
                return getattr(self.model.transformer, "kernels", PLAIN).new_cache(
                    self.model.config, positions, self.kv_dtype
                )
            return new_cache(positions)
        same = shared_prefix(cached_ids[: cache.length], self.prompt_ids.tolist()) if cached_ids else 0
        cache.truncate(min(same, n_prompt - 1))  # emptied, unless a conversation's turn keeps a prefix
        return cache

    def emit(self, phase: str, start: float, duration: float, **facts) -> None:
        """Tell the listener (if any) of ``phase``: ``start`` perf_counter seconds, ``duration`` seconds."""
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
        yield the text it releases (often nothing). ``step_t0``: when this step's forward began.
        With a constraint, the grammar's mask applies, and a run of tokens the grammar forces
        follows the sampled one, fed together at the next step (see :meth:`pending`). When logprobs
        are asked the run is ``queued`` instead and taken one id a step, so that each has the model's
        own logprob, from the logits of the id before it (the same ids, one pass each)."""
        if queued := bool(self.queued):  # the grammar left no choice: what the sampler drew from is one-hot
            token, allowed, probs = self.queued.pop(0), None, np.zeros(logits.shape[-1], np.float32)
            probs[token] = 1.0
        else:
            allowed = self.constraint.allowed() if self.constraint is not None else None
            args = (logits, self.params, self.rng, self.seen, self.new_ids, allowed)
            if self.listener is None and self.logprobs is None:
                token, probs = sampling.sample(*args), None
            else:  # the trace (and logprobs) show the distribution the token was drawn from
                token, probs = sampling.sample_with_probs(*args)
        now = time.perf_counter()
        if self.new_ids:  # a decode step's token
            self.metrics.decode_step_s.append(now - step_t0)
            yield from self.push(token, probs, step_t0, now=now, allowed=allowed, logits=logits, queued=queued)
            return
        self.metrics.ttft_s = now - self.t0  # the prefill's token: TTFT ends here
        n = len(self.prompt_ids) - self.reused  # the ids prefill fed
        delta, _ = self._add(token, probs, now, allowed, logits, queued=False)
        facts = dict(tokens=n, offset=self.cache.length - n, cache_length=self.cache.length, probs=probs, token=token)
        self.emit("prefill", step_t0, self.metrics.prefill_s, **facts)
        yield from self._show(delta)

    def push(self, token: int, probs, step_t0: float, *, cache_length=None, step_s=None, now=None, allowed=None,
             logits=None, queued=False):  # fmt: skip
        """Pass a chosen ``token`` through the stop chain (``take`` samples one; ``speculative_step.settle``
        pushes an accepted run); yield the text it releases. ``cache_length``: the positions before it
        (default the cache's length); ``step_s``: its share of the step's time; ``allowed``: the
        constraint's mask the token was drawn under (None without a constraint); ``logits``: the model's
        raw ``[vocab]`` it was drawn from (the logprobs'; None when nobody asked for them); ``queued``: the
        token is a forced run's, which the grammar's matcher consumed with the run (:meth:`take`)."""
        now = time.perf_counter() if now is None else now
        if step_s is not None:
            self.metrics.decode_step_s.append(step_s)
        cache_length = self.cache.length if cache_length is None else cache_length
        fed = self.seen[-1]  # the token this step fed in
        delta, forced = self._add(token, probs, now, allowed, logits, queued)
        self.emit(
            "decode",
            step_t0,
            now - step_t0 if step_s is None else step_s,
            step=len(self.new_ids) - 1 - len(forced),
            position=cache_length - 1,
            input_token=fed,
            token=token,
            probs=probs,
            cache_length=cache_length,
            last=self.stop_reason is not None,
            text=delta,
        )
        yield from self._show(delta)

    def _add(self, token: int, probs, now: float, allowed, logits, queued) -> tuple[str, list[int]]:
        """A chosen token, then the run the constraint forces after it (a stop may cut it): text, forced ids."""
        delta = self._append(token, probs, logits)
        done = self.constraint is None or self.stop_reason is not None or queued
        forced = [] if done else self.constraint.advance(token)
        if self.logprobs is not None and not queued:  # each forced id waits for the pass giving its logprob
            self.queued, forced = forced, []
        kept = 0
        for f in forced:  # the grammar's only way on: no sampling, probability 1
            if self.stop_reason is None:
                delta, kept = delta + self._append(f, None), kept + 1
        if kept < len(forced):  # a stop cut the run: the matcher goes back to where the ids end
            self.constraint.rollback(len(forced) - kept)
        if allowed is not None:
            run = forced[:kept] or self.queued
            self.emit("mask", now, self.constraint.mask_s, allowed=allowed, token=token, forced=run)
        return delta, forced[:kept]

    def _append(self, token: int, probs: np.ndarray | None, logits: np.ndarray | None = None) -> str:
        """One new id through the logprobs (the model's own, from ``logits``; ``probs``: what it was drawn
        from), the stop criteria and the stop chain; the text it releases."""
        if self.logprobs is not None:
            top = self.params.top_logprobs
            self.logprobs.append(sampling.model_logprobs(logits, token, top, probs))
        self.new_ids.append(token)
        self.seen.append(token)
        # room left once this token is part of the sequence (it would be fed at cache.length)
        room = self.cache.free_positions - (len(self.seen) - self.cache.length)
        reason = self.criteria.check(token, len(self.new_ids), room)
        delta = ""
        if reason is not StopReason.EOS:  # an EOS id ends the text; it is never shown
            delta = self.output.add(token)
            reason = self.output.stop_reason or reason
        self.stop_reason = reason
        return delta

    def pending(self) -> list[int]:
        """The ids not yet in the cache: the last sampled one, then any forced run (fed as one chunk; with
        logprobs a run is ``queued`` instead, see :meth:`take`)."""
        return self.seen[self.cache.length :]

    def _show(self, delta: str):
        if delta:
            self.emit("text", time.perf_counter(), 0.0, text=delta)
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
        if self.drafter is not None:
            self.drafter.release()
        if self.own_cache:
            self.cache.free()
        elif not self.keeps_cache:
            self.cache.reset()

    def finish(self) -> GenerationResult:
        """Name the condition that fired, tell the listener (stop, summary), return the result."""
        reason = self.stop_reason
        if self.queued:  # a stop cut a queued forced run: the matcher goes back to where the ids end
            self.constraint.rollback(len(self.queued))
            self.queued = []
        if self.output.stop_reason is not None:
            self.condition = self.output.condition
        elif reason is StopReason.CANCELLED and self.condition is None:
            self.condition = "the cancel event was set"
        elif reason is StopReason.TIMEOUT:
            self.condition = self.timeout_s
        elif reason is StopReason.EOS:
            self.condition = self.new_ids[-1]
        model, now = self.model, time.perf_counter()
        cut = self.output.text if self.output.stop_reason is not None else None  # the stop chain trimmed the text
        self.emit(
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
            cache="freed" if self.own_cache else "kept" if self.keeps_cache else "emptied",  # what release() did
        )
        self.emit(
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
            text=self.output.text,
            ids=self.new_ids,
            prompt_ids=self.prompt_ids.tolist(),
            stop_reason=reason,
            metrics=self.metrics,
            stop_condition=self.condition,
            logprobs=self.logprobs,
            incomplete=constraint_module.incomplete(self.constraint, reason, self.max_new_tokens, cut),
        )
