"""Continuous batching: many requests share each forward pass (nano-vllm's ``scheduler.py``, vLLM v1).

A request is its tokens (prompt, then the ids it sampled) and a paged KV cache that holds the
first ``seq.length`` of them. Prefill and decode are one rule: *feed the tokens not yet in the
cache*; when every token is in, the last row's logits give the next token. Each step::

    schedule: running requests first (oldest first), each feeds min(tokens left, budget):
                  a decode row is 1 token, a prompt is fed in chunks (chunked prefill);
              a decode that needs a new block and finds none preempts the newest request
                  (its blocks go back to the pool; it waits at the front and is recomputed later);
              then waiting requests join while the token budget and free blocks allow
    forward:  every fed token of every request, one [rows, d_model] matrix per projection
    sample:   requests whose tokens are all in the cache take a token; finished ones leave

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
from minillm.runtime.request import GenerationResult, Request


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
        self.pool, self.index = pool, index
        super().__init__(model, prompt, params, **options)
        self.seq: PagedSequence = self.cache
        self.deltas: list[str] = []
        self.result: GenerationResult | None = None
        # Slow motion (a classroom follows one step at a time): after each step it took part in,
        # the request sits out the steps of the next ``step_delay_s`` seconds, keeping its blocks;
        # the others keep their pace. Its measured step times never include the wait.
        self.step_delay_s = step_delay_s
        self.hold_until = 0.0  # time.perf_counter() seconds
        self.drafted: tuple[list[int], object] = ([], None)  # this step's draft ids and q (speculative)

    def new_cache(self, max_seq_len: int) -> PagedSequence:
        return PagedSequence(self.pool, max_seq_len)

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
    def schedule(self) -> tuple[list[tuple[BatchRequest, int]], list[BatchRequest], list[BatchRequest]]:
        """Pick this step's rows: ``[(request, tokens to feed)]``, plus who was admitted and preempted.
        Running requests that sit this step out for slow motion are kept in ``self.held``."""
        budget, rows, admitted, preempted = self.max_batched_tokens, [], [], []
        self.held = []
        now = time.perf_counter()
        for request in list(self.running):  # oldest first
            if request not in self.running:  # preempted earlier in this loop
                continue
            if request.hold_until > now:  # slow motion: it sits this step out, keeping its blocks
                self.held.append(request)
                continue
            if budget == 0:
                continue
            n = min(len(request.seen) - request.seq.length, budget)
            n += self._draft(request, n, budget)
            while not self.pool.can_grow(request.seq, n):  # a decode needs a block and none is free
                victim = self.running[-1]  # the newest request gives its blocks back
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                self.pool.grow(request.seq, n)
                rows.append((request, n))
                budget -= n
        identity = None
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
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
            admitted.append(request)
            rows.append((request, n))
            budget -= n
        return rows, admitted, preempted

    def _draft(self, request: BatchRequest, n: int, budget: int) -> int:
        """A speculative request about to decode proposes its drafts (kept in ``request.drafted``);
        returns how many positions they add to its row (none when no block is free for them)."""
        request.drafted = ([], None)
        if request.spec is None or not request.new_ids or n != 1 or request.seq.length != len(request.seen) - 1:
            return 0
        ids, q = request.spec.propose(limit=budget)
        if not ids or not self.pool.can_grow(request.seq, 1 + len(ids)):
            return 0
        request.drafted = (ids, q)
        return len(ids)

    def _preempt(self, request: BatchRequest) -> None:
        self.pool.release(request.seq)  # its full blocks stay cached: recomputing may reuse them
        request.metrics.preemptions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)

    # --- one step ----------------------------------------------------------------------------------
    def step(self) -> list[BatchRequest]:
        """Schedule, run one batched forward pass, sample where due; return the requests that finished."""
        t0 = time.perf_counter()
        finished = [r for r in (*self.running, *self.waiting) if not r.running()]  # cancel, deadline
        for request in finished:
            self._finish(request)
        rows, admitted, preempted = self.schedule()
        starts = [request.seq.length for request, _ in rows]
        fed = None if self.listener is None else [_row_facts(r, n, s) for (r, n), s in zip(rows, starts, strict=True)]
        if rows:
            chunks = [  # a speculative row feeds [last, d1 .. dk]
                (np.asarray(r.seen[s : s + n] if not r.drafted[0] else [r.seen[s], *r.drafted[0]]), r.seq)
                for (r, n), s in zip(rows, starts, strict=True)
            ]
            last_rows = [1 + len(r.drafted[0]) for r, _ in rows]  # k + 1 rows verify k drafts
            logits = self.model.transformer.forward_batch(chunks, last_rows=last_rows)  # [sum(last_rows), vocab]
            forward_s = time.perf_counter() - t0
            ends = np.cumsum(last_rows)
            for (request, n), start, end, m in zip(rows, starts, ends, last_rows, strict=True):
                request.metrics.target_passes += 1
                request.metrics.prompt_tokens_computed += max(0, min(start + n, len(request.prompt_ids)) - start)
                if request.step_delay_s > 0:
                    request.hold_until = time.perf_counter() + request.step_delay_s
                if not request.new_ids:
                    request.metrics.prefill_s += forward_s
                if request.drafted[0]:  # accept, roll the rejected drafts' blocks back, push the run
                    request.deltas.extend(request.spec.settle(logits[end - m : end], *request.drafted, t0))
                elif request.seq.length == len(request.seen):  # every token is in: sample the next
                    request.deltas.extend(request.take(logits[end - 1], t0))
                self.pool.register_full_blocks(request.seq, request.seen)  # after any rollback
                if request.stop_reason is not None:
                    finished.append(request)
                    self._finish(request)
        self.steps += 1
        if self.listener is not None:
            self._tell(t0, fed, admitted, preempted, finished)
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

    def _tell(self, t0, fed, admitted, preempted, finished) -> None:
        pool = self.pool
        self.listener.on_event(
            "batch_step",
            t0,
            time.perf_counter() - t0,
            self.model,
            {
                "step": self.steps,
                "rows": fed,
                "admitted": {r.index: r.seq.cached_tokens for r in admitted},
                "preempted": [r.index for r in preempted],
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


def _row_facts(request: BatchRequest, n: int, start: int) -> dict:
    """What one row of a step feeds: a decode (the last sampled token) or a prefill chunk, and
    whether it recomputes a preempted request's tokens."""
    decode = bool(request.new_ids) and start == len(request.seen) - 1
    return {
        "request": request.index,
        "tokens": n,
        "start": start,
        "kind": "decode" if decode else "prefill",
        "recompute": request.metrics.preemptions > 0 and not decode,
        "blocks": len(request.seq.block_table),  # KV blocks it holds during the step
    }
