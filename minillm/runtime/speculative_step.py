"""A request's speculative step, between the request and its draft (``speculative.py``).

The decoder knows nothing of the request and the request nothing of the decoder's state: these two
functions read the request's state, hand the decoder what it needs as arguments, and append what comes
back through the request's own stop chain (gpt-fast's ``speculative_decode`` returns tokens, its
``generate`` appends them)::

    proposal = propose(request)                      the draft's ids, within the request's room
    logits   = verify_step(model, last, proposal.ids, cache)   (or a row of a batched pass)
    settle(request, logits, proposal, t0)            accept, roll the cache back, push the kept run
"""

from __future__ import annotations

import time

from minillm.runtime import speculative
from minillm.runtime.request import Request
from minillm.runtime.speculative import Proposal

#: no drafts: a plain decode step
NO_DRAFTS = Proposal()


def propose(request: Request, limit: int | None = None) -> Proposal:
    """The drafts ``request`` verifies in its next pass: at most its decoder's ``k``, one fewer than the
    tokens it may still add and than its cache's free positions (with ``last``), and ``limit - 1``
    (``limit``: a batch step's token budget). None without a decoder, or while a constraint's forced run
    waits to be fed (or, with logprobs, to be taken one id a step: ``request.queued``).

    Raises:
        InvalidRequestError: the draft proposed ids outside the model's vocabulary.
    """
    if request.drafter is None or request.queued or (request.constraint is not None and len(request.pending()) != 1):
        return NO_DRAFTS
    most = min(request.max_new_tokens - len(request.new_ids), request.cache.free_positions) - 1
    if limit is not None:
        most = min(most, limit - 1)
    n_prompt = len(request.prompt_ids)
    return request.drafter.propose(request.seen, most, request.params, request.rng, n_prompt, request.constraint)


def settle(request: Request, logits, proposal: Proposal, step_t0: float):
    """After the forward over ``[last, *proposal.ids]`` (``logits`` ``[k + 1, vocab]``, an array or a
    ``steps.RowLogits``): accept (``speculative.accept``), roll the cache back to the kept positions, push
    the kept drafts and the model's token through the request (stopping at the first stop condition);
    yield the text they release. Counts ``drafted_tokens``, ``accepted_tokens`` (those the answer kept:
    none past a stop, as plain decoding never makes them), ``rejections`` (one reached before a stop) and
    ``verify_steps``; tells the request's listener ``verify``."""
    ids, cache, m = proposal.ids, request.cache, request.metrics
    start = cache.length - len(ids) - 1  # where ``last`` was written
    n, token = speculative.accept(logits, proposal, request.params, request.rng, request.seen, request.new_ids)
    cache.truncate(start + 1 + n)  # the rejected drafts' keys and values are forgotten
    m.drafted_tokens += len(ids)
    m.verify_steps += 1
    request.drafter.adapt(len(ids), n)
    run = [*ids[:n], token]
    step_s = (time.perf_counter() - step_t0) / len(run)
    shown = request.listener is not None or request.logprobs is not None  # who looks at the distribution
    for j, t in enumerate(run):
        mask, probs = proposal.masks[j], None
        if shown:
            probs = speculative.shown_probs(logits[j], request.params, request.seen, request.new_ids, mask)
        raw = logits[j] if request.logprobs is not None else None  # the logprobs are the model's own
        yield from request.push(t, probs, step_t0, cache_length=start + 1 + j, step_s=step_s, allowed=mask, logits=raw)
        if request.stop_reason is not None:  # never past a stop: the cache holds what came before it
            run = run[: j + 1]
            cache.truncate(start + len(run))
            break
    m.accepted_tokens += min(n, len(run))  # a stop inside the drafts cuts them
    m.rejections += n < len(ids) and len(run) > n  # the first mismatch, if the answer got to it
    if request.listener is not None:
        passes = max(m.target_passes, 1)
        request.emit(
            "verify",
            step_t0,
            time.perf_counter() - step_t0,
            drafted=ids,
            accepted=n,
            token=token,
            bonus=n == len(ids),
            kept=run,
            drafted_so_far=m.drafted_tokens,
            accepted_so_far=m.accepted_tokens,
            tokens_per_pass=len(request.new_ids) / passes,
        )
