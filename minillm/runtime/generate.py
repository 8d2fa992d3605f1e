"""The request loop: prefill once, then decode one token at a time until a stop condition fires.

    tokenize -> prefill -> sample -> [decode_step -> sample] ... -> stop -> free

The phases are the functions of ``steps.py``; the request's state (cache, stop chain, sampler,
measurements) is a :class:`~minillm.runtime.request.Request`. A listener (``tracer=``, e.g.
``minillm.Tracer``) hears each phase as it happens; without one, nothing is computed for it.
The loop follows gpt-fast's ``generate.py``: prefill the whole prompt, then a short decode loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from minillm.errors import InvalidRequestError
from minillm.model.paged_kv_cache import MIB, KVCachePool, blocks_for, check_block_size
from minillm.runtime import speculative_step, steps
from minillm.runtime.loading import Model
from minillm.runtime.request import GenerationResult, Request
from minillm.runtime.request_checks import check_arguments
from minillm.runtime.sampling import SamplingParams
from minillm.runtime.scheduler import BatchRequest, Scheduler
from minillm.runtime.steps import Prompt, decode_step, prefill, verify_step


def stream(
    model: Model,
    prompt: Prompt,
    params: SamplingParams | None = None,
    *,
    tracer=None,
    result: list | None = None,
    **options,
) -> Iterator[str]:
    """Run one request and yield its text as it is produced (UTF-8 safe deltas).

    Args:
        params: sampling parameters; default greedy. The repetition penalty counts the prompt's
            ids as seen, as transformers does.
        tracer: a listener with ``on_event(phase, start, duration, model, facts)``, e.g.
            ``minillm.Tracer``; start is ``time.perf_counter()`` seconds, duration seconds.
        result: if a list, the :class:`GenerationResult` is appended to it at the end.
        **options: the request's options, checked by :class:`~minillm.runtime.request.Request`:
            ``max_new_tokens`` (64), ``chat``, ``rng``, ``max_seq_len``, ``cache``, ``kv_dtype``
            (``"float32"`` | ``"float16"`` | ``"int8"``: how the request's KV cache holds entries), ``stop``,
            ``stop_token_ids``, ``include_stop_string``, ``timeout_s``, ``cancel``, ``constraint`` (a
            dict JSON schema or a ``Constraint``: the output follows it; ``constraint.py``), ``speculative``
            (a :class:`~minillm.runtime.speculative.Speculative`, or a draft name: ``"ngram"``,
            ``"self-int8"``, ``"self-gguf"``, ``"layers:K"``; the output has the model's own
            distribution, and greedy gives the same ids as without it; not with ``constraint``).

    Raises:
        InvalidRequestError: empty prompt, ``max_new_tokens <= 0``, an empty stop string or
            sequence, ``timeout_s <= 0``, a ``cancel`` that is neither Event nor callable, an
            unknown option, a ``kv_dtype`` outside float32 | float16 | int8, an invalid constraint (naming
            what is wrong) or llguidance missing for one.
        ContextWindowExceeded: the prompt leaves no room for a new token (before prefill).
    """
    if unknown := sorted(set(options) - Request.OPTIONS):
        raise InvalidRequestError(f"unknown request option(s) {unknown}; the options are {sorted(Request.OPTIONS)}.")
    request = Request(model, prompt, params, listener=tracer, **options)
    yield from run(request, result)


def run(request: Request, result: list | None = None) -> Iterator[str]:
    """Drive a built :class:`Request` to its end and yield its text deltas (the loop of :func:`stream`).

    Prefill feeds the prompt ids past those its cache already holds (``request.reused``: 0 but for a
    conversation's turn); ``result``, if a list, gets the :class:`GenerationResult` appended.
    """
    model = request.model
    try:
        try:
            if request.running():
                t = time.perf_counter()
                # the whole prompt (past what the cache holds), one forward pass
                logits = prefill(model, request.prompt_ids[request.reused :], request.cache)
                request.metrics.prefill_s = time.perf_counter() - t
                request.metrics.target_passes += 1
                yield from request.take(logits, t)  # the first new token: TTFT ends here
            while request.running():
                t = time.perf_counter()
                proposal = speculative_step.propose(request)  # no drafter: no drafts
                request.metrics.target_passes += 1
                if proposal.ids:  # verify k drafts in one pass over [last, d1 .. dk]: k + 1 rows of logits
                    logits = verify_step(model, request.new_ids[-1], proposal.ids, request.cache)
                    yield from speculative_step.settle(request, logits, proposal, t)
                    continue
                fed = request.pending()  # the last token; with a constraint, any run it forced after it
                if len(fed) == 1:
                    logits = decode_step(model, fed[0], request.cache)  # one position, cache reused
                else:
                    logits = prefill(model, fed, request.cache)  # a forced run: one pass, like a prompt chunk
                yield from request.take(logits, t)
        except KeyboardInterrupt:  # Ctrl-C during the model's work ends the request cleanly, as a cancel
            request.cancel("KeyboardInterrupt (Ctrl-C)")
        yield from request.flush()  # text held back for a stop string that never completed
    except GeneratorExit:  # the caller stopped reading: that is a cancel too
        request.cancel("the caller closed the stream")
    finally:
        request.release()  # the KV cache goes away with the request, however it ends
    done = request.finish()
    if result is not None:
        result.append(done)


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


def generate_batch(
    model: Model,
    prompts: list[Prompt],
    params: SamplingParams | list[SamplingParams | None] | None = None,
    *,
    max_new_tokens: int | list[int] = 64,
    per_prompt: list[dict] | None = None,
    kv_cache_mib: float | None = None,
    block_size: int = 16,
    max_batched_tokens: int = 512,
    max_num_seqs: int = 256,
    pool: KVCachePool | None = None,
    tracer=None,
    **options,
) -> list[GenerationResult]:
    """Run many requests together with continuous batching over a paged KV cache (``scheduler.py``).

    Each request gives the same result as :func:`generate` alone with the same arguments (greedy:
    the same ids; sampled: the same ids for the same seed, up to float32 rounding of the batched
    products): same stop chain, sampler and window (prompt + ``max_new_tokens``, at most the
    context).

    Args:
        prompts: one prompt per request (``str`` or a message list), at least one.
        params: one :class:`SamplingParams` for all, or a list with one per prompt (None: greedy).
        max_new_tokens: one budget for all, or a list with one per prompt.
        per_prompt: a list with one dict of request options per prompt (e.g. ``{"stop": ["\\n"]}``),
            overriding ``**options`` for that prompt.
        kv_cache_mib: the pool's size in MiB; default: room for every request's window at once
            (no preemption). Smaller pools admit fewer requests at once and preempt when full.
        block_size: positions per KV block (16).
        max_batched_tokens: tokens fed per step over all requests: prefill chunks + decode rows.
        max_num_seqs: requests running at once.
        pool: an existing :class:`KVCachePool` to reuse (its cached prefixes serve these prompts);
            overrides ``kv_cache_mib`` and ``block_size``.
        tracer: a listener told ``batch_step`` after every step (who ran, tokens fed, blocks
            used/free, prefix hits, preemptions, block tables), e.g. ``minillm.Tracer``.
        **options: request options for every prompt, as :func:`stream` (``chat``, ``stop``,
            ``stop_token_ids``, ``include_stop_string``, ``timeout_s``, ``cancel``, ``rng``,
            ``max_seq_len``, ``constraint``: one per prompt through ``per_prompt``; ``speculative``: each
            request drafts on its own and verifies its drafts as one chunk of ``k + 1`` tokens in the
            batched pass, rejected positions' blocks go back); not ``cache``; ``kv_dtype`` only
            ``"float32"`` (the paged pool's blocks are float32; float16/int8 KV work with
            :func:`generate` and :func:`stream`).

    Returns:
        one :class:`GenerationResult` per prompt, in the prompts' order; ``metrics`` adds
        ``cached_prompt_tokens`` (prefix reuse) and ``preemptions``.

    Raises:
        InvalidRequestError: no prompts, a per-prompt list whose length is not the prompts', an
            unknown option, ``block_size``/``max_batched_tokens``/``max_num_seqs`` < 1, a pool
            that holds no block, a ``kv_dtype`` other than float32, or any request argument
            :func:`stream` refuses.
        KVCachePoolTooSmall: a request needs more blocks than the whole pool (refused before any
            model work).
    """
    requests, pool = _batch_requests(model, prompts, params, max_new_tokens, per_prompt, pool, kv_cache_mib,
                                     block_size, options)  # fmt: skip
    scheduler = Scheduler(
        model, pool, max_batched_tokens=max_batched_tokens, max_num_seqs=max_num_seqs, listener=tracer
    )
    for r in requests:
        scheduler.add(r)  # refuses a request the pool could never hold, before any model work
    try:
        while scheduler.has_work():
            scheduler.step()
    except KeyboardInterrupt:  # Ctrl-C: every unfinished request ends cancelled, its blocks freed
        scheduler.cancel_all("KeyboardInterrupt (Ctrl-C)")
    finally:
        for r in (*scheduler.running, *scheduler.waiting):  # an error mid-step: give the blocks back
            r.seq.reset()
    return [r.result for r in requests]


def _batch_requests(model, prompts, params, max_new_tokens, per_prompt, pool, kv_cache_mib, block_size,
                    options) -> tuple[list, KVCachePool]:  # fmt: skip
    """One :class:`BatchRequest` per prompt, its arguments checked (``generate_batch``'s, same errors),
    each on ``pool`` or, with none given, on a pool made for them: the prompts are rendered and
    tokenized first (once: each request takes its ids as ``prepared``), so the pool's size is known
    before any request or sequence is built."""
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(
            f"generate_batch takes a list of prompts, got {type(prompts).__name__}; for one prompt pass [prompt] "
            "or call generate."
        )
    if not prompts:
        raise InvalidRequestError("generate_batch got an empty list of prompts; pass at least one prompt.")
    n = len(prompts)
    if unknown := sorted(set(options) - BatchRequest.OPTIONS):
        raise InvalidRequestError(
            f"unknown request option(s) {unknown}; the options are {sorted(BatchRequest.OPTIONS)}."
        )
    if pool is None:
        check_block_size(block_size)
    params_list = _per_prompt("params", params, n, SamplingParams)
    budgets = _per_prompt("max_new_tokens", max_new_tokens, n, int)
    overrides = _per_prompt("per_prompt", per_prompt, n, dict) if per_prompt is not None else [{}] * n
    for j, extra in enumerate(overrides):
        if unknown := sorted(set(extra) - BatchRequest.OPTIONS):
            raise InvalidRequestError(f"per_prompt[{j}] has unknown option(s) {unknown}.")

    kwargs = [{**options, **extra} for extra in overrides]
    prepared = [None] * n
    if pool is None:
        for m, kw in zip(budgets, kwargs, strict=True):
            check_arguments(m, kw.get("timeout_s"))  # before a budget sizes the pool
        prepared = [steps.prepare(model, text, chat=kw.get("chat")) for text, kw in zip(prompts, kwargs, strict=True)]
        pool = _pool_for(model, prepared, budgets, kwargs, kv_cache_mib, block_size)
    requests = [
        BatchRequest(model, prompt, p, pool=pool, index=j, max_new_tokens=m, listener=None, prepared=prep, **kw)
        for j, (prompt, p, m, kw, prep) in enumerate(zip(prompts, params_list, budgets, kwargs, prepared, strict=True))
    ]
    return requests, pool


def _pool_for(model: Model, prepared: list, budgets: list[int], kwargs: list[dict], kv_cache_mib: float | None,
              block_size: int) -> KVCachePool:  # fmt: skip
    """A pool of ``kv_cache_mib`` MiB, by default sized for every request at once: each one's
    :attr:`~minillm.runtime.scheduler.BatchRequest.positions_needed` (prompt + new tokens - 1, at most
    its ``max_seq_len`` or the model's context), from its prepared ids."""
    if kv_cache_mib is None:
        context = model.config.max_position_embeddings
        blocks = 0
        for (_, ids, _), m, kw in zip(prepared, budgets, kwargs, strict=True):
            positions = min(kw.get("max_seq_len") or context, len(ids) + m - 1)
            blocks += blocks_for(positions, block_size)
        kv_cache_mib = blocks * block_size * model.config.kv_bytes_per_token() / MIB
    return KVCachePool.for_model(model.config, kv_cache_mib, block_size)


def _per_prompt(name: str, value, n: int, kind: type) -> list:
    """``value`` for every prompt, or a list of one per prompt (its length checked)."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InvalidRequestError(
                f"{name} is a list of {len(value)} but there are {n} prompts; pass one {kind.__name__} for all, "
                f"or a list of exactly {n}."
            )
        return list(value)
    return [value] * n
