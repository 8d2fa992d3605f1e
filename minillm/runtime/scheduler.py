"""Continuous batching: many requests share each forward pass (nano-vllm's ``scheduler.py``, vLLM v1).

A request is its tokens (prompt, then the ids it sampled) and a paged KV cache that holds the
first ``seq.length`` of them. Prefill and decode are one rule: *feed the tokens not yet in the
cache*; when every token is in, the last row's logits give the next token. Each step is
schedule -> execute -> apply (``plan.py``)::

    schedule: a Plan (data): running requests first (oldest first), each feeds min(tokens left, budget):
                  a decode row is 1 token (a speculative one 1 + its drafts), a prompt is fed in
                  chunks (chunked prefill);
              a decode that needs a new block and finds none preempts the newest request
                  (its blocks go back to the pool; it waits at the front and is recomputed later);
              then waiting requests join while the token budget and free blocks allow
    execute:  every fed token of every request, one [rows, d_model] matrix per projection
    apply:    requests whose tokens are all in the cache take a token (or settle their drafts);
              finished ones leave

``max_batched_tokens`` caps the rows per step, so a long prompt cannot stall running decodes for
more than a step's worth of work. Admission reserves blocks for a request's known tokens (prefix
blocks from the cache are shared, found under the request's ``kv_identity``: the model, its
precision and adapters as set at admission); decode steps add a block every ``block_size`` tokens. Timing
is measured *around* the step, never inside the math.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from minillm.errors import InvalidRequestError, KVCachePoolTooSmall
from minillm.model.paged_kv_cache import KVCachePool, PagedSequence
from minillm.runtime.kv_identity import kv_identity
from minillm.runtime.loading import Model
from minillm.runtime.plan import Plan, Row, apply, execute
from minillm.runtime.request import GenerationResult, Request
from minillm.runtime.speculative import Proposal
from minillm.runtime.speculative_step import NO_DRAFTS, propose


class BatchRequest(Request):
    """A :class:`Request` whose KV cache is a sequence of the shared pool; ``index`` is its place
    in the caller's list; ``step_delay_s``: slow motion, seconds it sits out after each step it took
    part in (0: none). ``deltas`` collects the text it releases, ``result`` its end."""

    OPTIONS = Request.OPTIONS - {"cache"}

    def __init__(self, model: Model, prompt, params, *, pool: KVCachePool, index: int, step_delay_s: float = 0.0,
                 **options):  # fmt: skip
        if options.get("kv_dtype") not in (None, "float32"):
            # the pool's blocks are float32 arrays shared by every sequence; a per-request dtype would
            # need a pool per dtype (not built)
            raise InvalidRequestError(
                f"kv_dtype={options['kv_dtype']!r}: generate_batch's paged KV pool holds float32 entries only; "
                "use kv_dtype='float32' (or none) here, or generate/stream, whose one-request KVCache holds "
                "float32, float16 or int8."
            )
        super().__init__(model, prompt, params, new_cache=lambda positions: PagedSequence(pool, positions), **options)
        self.pool, self.index = pool, index
        self.seq: PagedSequence = self.cache
        self.deltas: list[str] = []
        self.delta_ids: list[int] = []  # per delta: the new ids released by then (a stream's logprobs)
        self.result: GenerationResult | None = None
        # Slow motion (a classroom follows one step at a time): after each step it took part in,
        # the request sits out the steps of the next ``step_delay_s`` seconds, keeping its blocks;
        # the others keep their pace. Its measured step times never include the wait.
        self.step_delay_s = step_delay_s
        self.hold_until = 0.0  # time.perf_counter() seconds

    def _show(self, delta: str):
        """:meth:`Request._show`, noting in ``delta_ids`` how many new ids each delta's text comes from."""
        for text in super()._show(delta):
            self.delta_ids.append(len(self.new_ids))
            yield text

    @property
    def positions_needed(self) -> int:
        """The most positions it will ever hold: prompt + new tokens - 1 (the last is never fed), at
        most its window."""
        return min(self.window, len(self.prompt_ids) + self.max_new_tokens - 1)


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each feeds; runs the step.

    Args:
        model: the loaded model.
        pool: the :class:`KVCachePool` every request's cache lives in.
        max_batched_tokens: tokens fed per step, over all requests (>= 1).
        max_num_seqs: requests running at once (>= 1).
        listener: told ``on_event("batch_step", ...)`` after every step (who ran, blocks, hits,
            preemptions, block tables); None computes nothing for it.

    Raises:
        InvalidRequestError: ``max_batched_tokens`` or ``max_num_seqs`` below 1.
    """

    def __init__(
        self, model: Model, pool: KVCachePool, *, max_batched_tokens: int = 512, max_num_seqs: int = 256, listener=None
    ):
        for name, value in (("max_batched_tokens", max_batched_tokens), ("max_num_seqs", max_num_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be a whole number >= 1, got {value!r}.")
        self.model, self.pool, self.listener = model, pool, listener
        self.max_batched_tokens, self.max_num_seqs = max_batched_tokens, max_num_seqs
        self.waiting: deque[BatchRequest] = deque()
        self.running: list[BatchRequest] = []  # in admission order: the last is the newest
        self.steps = 0
        self.held: list[BatchRequest] = []  # running requests the last step left out for slow motion

    def add(self, request: BatchRequest) -> None:
        """Queue a request; refuse it now if the whole pool could never hold it.

        Raises:
            KVCachePoolTooSmall: its prompt and new tokens need more blocks than the pool has.
        """
        pool = self.pool
        need = pool.blocks_for(request.positions_needed)
        if need > pool.num_blocks:
            n_prompt = len(request.prompt_ids)
            raise KVCachePoolTooSmall(
                f"request {request.index}: its prompt of {n_prompt:,} tokens and up to {request.max_new_tokens:,} "
                f"new tokens need {request.positions_needed:,} positions = {need} blocks of {pool.block_size}, "
                f"but the whole KV cache pool holds {pool.num_blocks} blocks ({pool.nbytes / 2**20:.1f} MiB); "
                f"pass kv_cache_mib >= {need * pool.bytes_per_block / 2**20:.1f}, or shorten the prompt or "
                "lower max_new_tokens."
            )
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def seconds_until_ready(self) -> float:
        """0 when a step would feed someone; else seconds until the first slow-motion request
        may run again (every running request sits out, none waits)."""
        if self.waiting or not self.running:
            return 0.0
        return max(0.0, min(r.hold_until for r in self.running) - time.perf_counter())

    # --- who runs this step ----------------------------------------------------------------------
    def schedule(self) -> Plan:
        """Plan this step (:class:`~minillm.runtime.plan.Plan`): each row's tokens, who was admitted and
        preempted, and the running requests that sit this step out for slow motion (``held``)."""
        plan, budget, now = Plan(), self.max_batched_tokens, time.perf_counter()
        for request in list(self.running):  # oldest first
            if request not in self.running:  # preempted earlier in this loop
                continue
            if request.hold_until > now:  # slow motion: it sits this step out, keeping its blocks
                plan.held.append(request)
                continue
            if budget == 0:
                continue
            n = min(len(request.seen) - request.seq.length, budget)
            draft = self._draft(request, n, budget)
            n += len(draft.ids)
            while not self.pool.can_grow(request.seq, n):  # a decode needs a block and none is free
                victim = self.running[-1]  # the newest request gives its blocks back
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    break
            else:
                self.pool.grow(request.seq, n)
                plan.rows.append(_row(request, n, draft))
                budget -= n
        identity = None
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not plan.preempted:
            request = self.waiting[0]
            if identity is None:  # what the keys it computes now depend on besides its ids
                identity = kv_identity(self.model, self.pool.keys.dtype.name)
            request.seq.identity = identity
            if not self.pool.can_allocate(request.seen, identity):
                break  # arrival order: no one overtakes the request at the head
            self.waiting.popleft()
            cached = self.pool.allocate(request.seq, request.seen)
            if request.metrics.preemptions == 0:
                request.metrics.cached_prompt_tokens = cached
            n = min(len(request.seen) - request.seq.length, budget)
            self.running.append(request)
            plan.admitted.append(request)
            plan.rows.append(_row(request, n))
            budget -= n
        return plan

    def _draft(self, request: BatchRequest, n: int, budget: int) -> Proposal:
        """A speculative request about to decode proposes its drafts (``speculative_step.propose``): none
        when it is not decoding one token, or when no block is free for them."""
        if not request.new_ids or n != 1 or request.seq.length != len(request.seen) - 1:
            return NO_DRAFTS
        proposal = propose(request, limit=budget)
        if not proposal.ids or not self.pool.can_grow(request.seq, 1 + len(proposal.ids)):
            return NO_DRAFTS
        return proposal

    def _preempt(self, request: BatchRequest) -> None:
        self.pool.release(request.seq)  # its full blocks stay cached: recomputing may reuse them
        request.metrics.preemptions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)

    # --- one step: schedule -> execute -> apply ----------------------------------------------------
    def step(self) -> list[BatchRequest]:
        """Plan, run one batched forward pass, apply its results; return the requests that finished."""
        t0 = time.perf_counter()
        finished = [r for r in (*self.running, *self.waiting) if not r.running()]  # cancel, deadline
        for request in finished:
            self._finish(request)
        plan = self.schedule()
        self.held = plan.held
        fed = None if self.listener is None else [_row_facts(row) for row in plan.rows]
        if plan.rows:
            logits = execute(self.model, plan)
            for request in apply(plan, logits, self.pool, t0, time.perf_counter() - t0):
                finished.append(request)
                self._finish(request)
        self.steps += 1
        if self.listener is not None:
            self._tell(t0, fed, plan, finished)
        return finished

    def _finish(self, request: BatchRequest) -> None:
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        request.deltas.extend(request.flush())
        request.release()  # its blocks go back to the pool; full ones stay cached
        request.result = request.finish()

    def cancel_all(self, why: str) -> None:
        """End every unfinished request as cancelled (Ctrl-C)."""
        for request in (*self.running, *self.waiting):
            request.cancel(why)
            self._finish(request)

    def _tell(self, t0, fed, plan: Plan, finished) -> None:
        pool = self.pool
        self.listener.on_event(
            "batch_step",
            t0,
            time.perf_counter() - t0,
            self.model,
            {
                "step": self.steps,
                "rows": fed,
                "admitted": {r.index: r.seq.cached_tokens for r in plan.admitted},
                "preempted": [r.index for r in plan.preempted],
                "finished": [r.index for r in finished],
                "waiting": [r.index for r in self.waiting],
                "tables": {r.index: list(r.seq.block_table) for r in self.running},
                "ref_count": list(pool.ref_count),
                "cached_free": [b for b in pool.free_blocks if pool.block_hash[b] is not None],
                "blocks_used": pool.num_used_blocks,
                "blocks_free": pool.num_free_blocks,
                "blocks_total": pool.num_blocks,
                "block_size": pool.block_size,
            },
        )


def _row(request: BatchRequest, n: int, draft: Proposal = NO_DRAFTS) -> Row:
    """The row feeding ``request``'s next ``n`` tokens from its cache's length: its known ids not yet in the
    cache, or a speculative row's ``[last, d1 .. dk]``."""
    start = request.seq.length
    ids = request.seen[start : start + n] if not draft.ids else [request.seen[start], *draft.ids]
    return Row(request, start, np.asarray(ids), draft)


def _row_facts(row: Row) -> dict:
    """What one row of a step feeds: a decode (the last sampled token) or a prefill chunk, and
    whether it recomputes a preempted request's tokens."""
    request, start = row.request, row.start
    decode = bool(request.new_ids) and start == len(request.seen) - 1
    return {
        "request": request.index,
        "tokens": len(row.ids),
        "start": start,
        "kind": "decode" if decode else "prefill",
        "recompute": request.metrics.preemptions > 0 and not decode,
        "blocks": len(request.seq.block_table),  # KV blocks it holds during the step
    }
