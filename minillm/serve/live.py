"""What the worker tells ``GET /v1/events``: its requests, steps and KV pool, as plain JSON events.

The worker calls these hooks; each returns at once when nobody subscribes (``bus.active`` is
False): no event is built, and the scheduler gets no listener, so it computes nothing for one.

    request.queued          the server accepted it (HTTP side)
    request.admitted        the scheduler let it run: its prompt ids, cached prefix, slow motion
    request.prefill_chunk   one chunk of its prompt fed in a step
    request.token           one sampled token: id, piece, text, probability, top-5 candidates
    request.text            the text its detokenizer released in a step (the answer, piece by piece)
    request.preempted       its blocks were taken back; it waits to be recomputed
    request.finished        why it stopped, token counts, TTFT and TPOT (seconds), its whole text
    step                    one scheduler step of a model: start, duration, one row per request fed, and
                            the running requests that sat it out for slow motion (``held``)
    pool                    that model's KV pool after the step: blocks used / free / cached, block tables
    load                    a model's load phases (always kept: a page opened later shows them); with
                            several models each names its model, and ``unloaded`` says one was evicted

Requests are named by the server's request id (``chatcmpl-...``); ``index`` is the scheduler's number.
Each ``request.*`` event is published with its owner, the label of the key that sent the request
(``job.owner``): the bus sends it whole, redacted or not at all, by subscriber (``privacy.py``).
"""

from __future__ import annotations

import minillm

from .events import EventBus


class LiveFeed:
    """Turns the worker's state into events on ``bus`` (the worker thread calls every hook but
    :meth:`queued`, which the event loop calls)."""

    def __init__(self, bus: EventBus):
        self.bus = bus
        self._step = None  # (start, duration, facts) of the last batch_step, while subscribed
        self._read: dict[int, int] = {}  # request index -> trace events already turned into tokens
        self._said: dict[int, int] = {}  # request index -> characters of its text already published

    # --- what the scheduler tells us (it is the scheduler's listener while someone subscribes) --
    def on_event(self, phase: str, start: float, duration: float, model, facts: dict) -> None:
        if phase == "batch_step":
            self._step = (start, duration, facts)

    def before_step(self, scheduler) -> None:
        """Listen to the coming step only if someone subscribes (else the scheduler computes nothing)."""
        scheduler.listener = self if self.bus.active else None
        self._step = None

    # --- hooks ---------------------------------------------------------------------------------
    def load(self, phase: str, **facts) -> None:
        """A load phase (loading, loaded, warmup, ready, failed); kept even with no subscriber."""
        self.bus.publish("load", {"phase": phase, **facts})

    def queued(self, job) -> None:
        if self.bus.active:
            data = {"id": job.request_id, "chat": job.chat, "max_tokens": job.max_tokens}
            self.bus.publish("request.queued", data, owner=job.owner)

    def finished(self, record: dict) -> None:
        """A request's end, from the trace record the worker keeps for GET /v1/traces/{id}."""
        if not self.bus.active:
            return
        summary = next((e["data"] for e in record["events"] if e["phase"] == "summary"), {})
        stop = next((e["data"] for e in record["events"] if e["phase"] == "stop"), {})
        ttft = summary.get("ttft_s")
        self.bus.publish(
            "request.finished",
            {
                "id": record["id"],
                "stop_reason": record["stop_reason"],
                "note": record["note"],
                "prompt_tokens": summary.get("prompt_tokens", 0),
                "cached_tokens": summary.get("cached_prompt_tokens", 0),
                "completion_tokens": summary.get("new_tokens", 0),
                "ttft_s": record["queue_wait_s"] + ttft if ttft else None,
                "tpot_s": summary.get("tpot_s"),
                "slow_motion_s": record.get("slow_motion_s", 0.0),
                "text": stop.get("text"),  # the whole answer; None when it ended without a stop (an error)
            },
            owner=record.get("key"),
        )

    def after_step(self, worker) -> None:
        """The events of the step that just ran (call it before the worker answers finished requests)."""
        if self._step is None or not self.bus.active:
            return
        start, duration, facts = self._step
        self._step = None
        active = worker.active
        names = {i: a.job.request_id for i, a in active.items()}
        owners = {i: a.job.owner for i, a in active.items()}
        step = facts["step"]
        for index, cached in facts["admitted"].items():
            if index in active:
                self._admitted(worker.model, active[index], step, cached)
        rows = [self._row(r, names) for r in facts["rows"]]
        # the scheduler's own list: running requests it left out of this step for slow motion
        # (never one it fed, however long it holds after)
        running = worker.scheduler.running
        held = [names[r.index] for r in worker.scheduler.held if r in running and r.index in names]
        self.bus.publish(
            "step",
            {
                "model": worker.served_name,  # several models: each steps its own batch, on one thread
                "step": step,
                "start": round(start - self.bus.t0, 6),
                "duration_s": duration,
                "rows": rows,
                "held": held,
                "waiting": [names[i] for i in facts["waiting"] if i in names],
            },
        )
        for row in rows:
            if row["phase"] == "prefill":
                data = {"id": row["id"], "step": step, **_chunk(row)}
                self.bus.publish("request.prefill_chunk", data, owner=owners.get(row["index"]))
            if row["index"] in active:
                self._tokens(worker, active[row["index"]], step)
        for a in active.values():  # fed, or ended (cancelled, its held text flushed)
            self._text(a, step)
        for index in facts["preempted"]:
            data = {"id": names.get(index, str(index)), "step": step}
            self.bus.publish("request.preempted", data, owner=owners.get(index))
        self._pool(worker, facts, names)

    # --- the pieces ------------------------------------------------------------------------------
    def _admitted(self, model, a, step: int, cached: int) -> None:
        ids = [int(i) for i in a.request.prompt_ids]
        tok = model.tokenizer
        self.bus.publish(
            "request.admitted",
            {
                "id": a.job.request_id,
                "index": a.request.index,
                "step": step,
                "prompt_tokens": len(ids),
                "cached_tokens": cached,
                "prompt": [[i, tok.piece_for_display(i)] for i in ids],
                "readmitted": a.request.metrics.preemptions > 0,
                "slow_motion_s": a.job.slow_motion_s,
                "queue_wait_s": a.wait,
            },
            owner=a.job.owner,
        )

    @staticmethod
    def _row(r: dict, names: dict) -> dict:
        return {
            "id": names.get(r["request"], str(r["request"])),
            "index": r["request"],
            "phase": r["kind"],
            "tokens": r["tokens"],
            "start": r["start"],
            "blocks": r["blocks"],
            "recompute": r["recompute"],
        }

    def _tokens(self, worker, a, step: int) -> None:
        """One request.token per token this step sampled, read from the request's trace."""
        events = a.tracer.events
        done = self._read.pop(a.request.index, 0)
        if a.request.result is None:  # still running: remember how far its trace was read
            self._read[a.request.index] = len(events)
        for e in events[done:]:
            if e.phase not in ("prefill", "decode"):
                continue
            n = 0 if e.phase == "prefill" else e.data["step"]
            token_id = int(a.request.new_ids[n])
            piece = worker.model.tokenizer.piece_for_display(token_id)
            cands = [[p, float(q)] for p, q in e.data["candidates"]]
            prob = e.data["prob"] if e.phase == "decode" else dict(e.data["candidates"]).get(piece)
            self.bus.publish(
                "request.token",
                {
                    "id": a.job.request_id,
                    "step": step,
                    "n": n,
                    "token_id": token_id,
                    "piece": piece,
                    "text": minillm.detokenize(worker.model, [token_id], skip_special_tokens=False),
                    "prob": None if prob is None or prob != prob else float(prob),
                    "top": cands,
                },
                owner=a.job.owner,
            )

    def _text(self, a, step: int) -> None:
        """One request.text with what the request's detokenizer released since the last one (the
        stop chain's text: UTF-8 whole, a stop string's prefix held back until it cannot match)."""
        text = a.request.output.text
        said = self._said.pop(a.request.index, 0)
        if a.request.result is None:
            self._said[a.request.index] = len(text)
        if len(text) > said:
            data = {"id": a.job.request_id, "step": step, "text": text[said:]}
            self.bus.publish("request.text", data, owner=a.job.owner)

    def _pool(self, worker, facts: dict, names: dict) -> None:
        self.bus.publish(
            "pool",
            {
                "model": worker.served_name,  # several models: each has its own pool
                "step": facts["step"],
                "blocks_total": facts["blocks_total"],
                "blocks_used": facts["blocks_used"],
                "blocks_free": facts["blocks_free"],
                "blocks_cached": len(facts["cached_free"]),
                "block_size": facts["block_size"],
                "bytes_per_block": worker.pool.bytes_per_block,
                "tables": {names.get(i, str(i)): t for i, t in facts["tables"].items()},
                "cached_free": facts["cached_free"],
            },
        )


def _chunk(row: dict) -> dict:
    return {"start": row["start"], "tokens": row["tokens"], "recompute": row["recompute"]}
