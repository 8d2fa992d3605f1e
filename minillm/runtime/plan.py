"""One engine step as data: the scheduler plans it, :func:`execute` runs the pass, :func:`apply` settles it.

vLLM's ``schedule()`` returns what its model runner executes and ``update_from_output`` applies;
nano-vllm's engine step is ``schedule -> run -> postprocess``. Here::

    plan = scheduler.schedule()        which requests feed which tokens (Row), who joined, who left
    logits = execute(model, plan)      ONE batched forward over every row          [sum(logit_rows), vocab]
    stopped = apply(plan, logits, ...) each row: sample, or settle its drafts; register full blocks

Slow motion and speculation are data of the plan (``Plan.held``, ``Row.draft``) and of the apply
(``hold_until``), not branches in the loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from minillm.model.paged_kv_cache import KVCachePool
from minillm.runtime.speculative import Proposal
from minillm.runtime.speculative_step import NO_DRAFTS, settle


@dataclass(frozen=True)
class Row:
    """One request's part of a pass: ``ids`` ``[n]`` int64 fed at cache positions ``start..start + n - 1``.

    ``draft``: a speculative row's :class:`~minillm.runtime.speculative.Proposal` (``k`` drafts after the
    last sampled token); the row then feeds ``[last, d1 .. dk]`` and asks for ``k + 1`` rows of logits
    (every draft checked in one pass). No drafts: a prefill chunk or a decode row, whose last row's logits
    choose the next token once every known token is in the cache.
    """

    request: object  # a scheduler.BatchRequest
    start: int
    ids: np.ndarray
    draft: Proposal = NO_DRAFTS

    @property
    def logit_rows(self) -> int:
        """Rows of logits this row needs: its last one, or ``k + 1`` to verify ``k`` drafts."""
        return 1 + len(self.draft.ids)


@dataclass
class Plan:
    """What one step does: ``rows`` (oldest running first, then the admitted), the requests admitted and
    preempted while planning it, and ``held``: running requests sitting this step out (slow motion)."""

    rows: list[Row] = field(default_factory=list)
    admitted: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    held: list = field(default_factory=list)

    @property
    def logit_rows(self) -> list[int]:
        return [row.logit_rows for row in self.rows]


def execute(model, plan: Plan) -> np.ndarray:
    """The pass: every row's tokens through the model at once, each into its own paged cache.

    Args:
        model: the loaded model (``loading.Model``).
        plan: the step's :class:`Plan`; no rows: no pass.

    Returns:
        float32 logits ``[sum(plan.logit_rows), vocab]``: each row's last row, or its ``k + 1`` rows when
        it verifies drafts, in the rows' order (``[0, vocab]`` when the plan has no rows).
    """
    if not plan.rows:
        return np.zeros((0, model.config.vocab_size), dtype=np.float32)
    chunks = [(row.ids, row.request.seq) for row in plan.rows]
    return model.transformer.forward_batch(chunks, last_rows=plan.logit_rows)  # [sum(logit_rows), vocab]


def apply(plan: Plan, logits: np.ndarray, pool: KVCachePool, step_t0: float, forward_s: float) -> list:
    """Settle the pass's results on its requests, row by row; return those that stopped.

    Each row counts a pass of the model (and the prompt tokens it computed); a request still in its
    prompt adds ``forward_s`` to its prefill time. A speculative row settles its drafts (accept, roll the
    rejected positions back, push the kept run); a row whose every known token is now in the cache
    samples the next one (a prefill chunk that is not the prompt's last samples nothing). The request's
    newly full blocks enter the prefix cache (after any rollback); slow motion's ``hold_until`` is set
    ``step_delay_s`` from now (0: it may run next step). Text released goes to ``request.deltas``.

    Args:
        logits: :func:`execute`'s output for ``plan``; ``pool``: the requests' KV pool;
        step_t0: ``time.perf_counter()`` when the step began; ``forward_s``: seconds to the pass's end.
    """
    stopped = []
    ends = np.cumsum(plan.logit_rows)
    for row, end in zip(plan.rows, ends, strict=True):
        request, m = row.request, row.logit_rows
        request.metrics.target_passes += 1
        n_prompt = len(request.prompt_ids)
        request.metrics.prompt_tokens_computed += max(0, min(row.start + len(row.ids), n_prompt) - row.start)
        request.hold_until = time.perf_counter() + request.step_delay_s
        if not request.new_ids:
            request.metrics.prefill_s += forward_s
        if row.draft.ids:  # accept, roll the rejected drafts' blocks back, push the run
            request.deltas.extend(settle(request, logits[end - m : end], row.draft, step_t0))
        elif request.seq.length == len(request.seen):  # every token is in: sample the next
            request.deltas.extend(request.take(logits[end - 1], step_t0))
        pool.register_full_blocks(request.seq, request.seen)
        if request.stop_reason is not None:
            stopped.append(request)
    return stopped
