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
from minillm.runtime.loading import Model
from minillm.runtime.request import GenerationResult, Request
from minillm.runtime.sampling import SamplingParams
from minillm.runtime.steps import Prompt, decode_step, prefill


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
            ``max_new_tokens`` (64), ``chat``, ``rng``, ``max_seq_len``, ``cache``, ``stop``,
            ``stop_token_ids``, ``include_stop_string``, ``timeout_s``, ``cancel``.

    Raises:
        InvalidRequestError: empty prompt, ``max_new_tokens <= 0``, an empty stop string or
            sequence, ``timeout_s <= 0``, a ``cancel`` that is neither Event nor callable, an
            unknown option.
        ContextWindowExceeded: the prompt leaves no room for a new token (before prefill).
    """
    if unknown := sorted(set(options) - Request.OPTIONS):
        raise InvalidRequestError(f"unknown request option(s) {unknown}; the options are {sorted(Request.OPTIONS)}.")
    request = Request(model, prompt, params, listener=tracer, **options)
    try:
        try:
            if request.running():
                t = time.perf_counter()
                logits = prefill(model, request.prompt_ids, request.cache)  # the whole prompt, one forward pass
                request.metrics.prefill_s = time.perf_counter() - t
                yield from request.take(logits, t)  # the first new token: TTFT ends here
            while request.running():
                t = time.perf_counter()
                logits = decode_step(model, request.new_ids[-1], request.cache)  # one position, cache reused
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
