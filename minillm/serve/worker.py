"""The model worker: ONE thread runs the model; requests join a continuous batch between steps.

    event loop (HTTP)                               worker thread (NumPy)
    ----------------                               ---------------------
    submit(job) --- queue.Queue(maxsize) -------->  between steps: jobs -> scheduler.add(request)
    await job.channel.get()  <-- call_soon_threadsafe --  scheduler.step(): one forward for all rows
    client gone: job.cancel.set()  ------------->  checked between steps -> StopReason.CANCELLED

NumPy never runs on the event loop, so while requests decode, the loop still answers /health,
/metrics and new requests. The loop and the thread share only the job's ``asyncio.Queue`` (written
through ``loop.call_soon_threadsafe``) and its ``threading.Event``. The requests running together
share one paged KV-cache pool (``--kv-cache-mib``) and the scheduler of ``generate_batch``
(``minillm/runtime/scheduler.py``): a long prompt is fed in chunks (``--max-batched-tokens``) so
running decodes keep their pace, at most ``--max-num-seqs`` run at once, and a prompt that starts
with blocks already in the pool reuses them (``usage.prompt_tokens_details.cached_tokens``).

The worker is one of the two shapes of :class:`~minillm.serve.interface.ServedModels`, the one
interface the HTTP layer talks to (the other: ``models.py``'s registry of several models).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import replace
from pathlib import Path

import minillm
from minillm.runtime.loading import run_warmup
from minillm.runtime.scheduler import Scheduler
from minillm.runtime.steps import prepare

from . import logprobs as lp
from .events import EventBus
from .gauges import Gauges
from .jobs import Active, Job, Outcome, QueueFullError
from .live import LiveFeed
from .metrics import ServerMetrics
from .privacy import request_tracer
from .reliability import Guard, GuardedRequest, MiniLLMBug, describe, hold_admission
from .traces import TraceStore

__all__ = ["Active", "Job", "Outcome", "QueueFullError", "Worker"]


class Worker(Gauges):
    """Loads the model, then runs queued jobs together, a continuous batch, on its own thread.

    Implements :class:`~minillm.serve.interface.ServedModels` for one model.

    Args:
        model_name: a name from ``minillm models`` or a local folder.
        served_name: the name clients pass as ``model`` (default ``model_name``).
        max_queue: how many requests may *wait* (running ones not counted); beyond: QueueFullError.
        max_num_seqs: requests running at once (the rest wait).
        kv_cache_mib: the paged KV-cache pool every running request's keys and values share.
        max_batched_tokens: tokens fed per step over all requests (prefill chunks + decode rows).
        block_size: positions per KV block.
        request_timeout_s: seconds from arrival (queue wait included) after which a request stops
            with StopReason.TIMEOUT; None: no limit.
        max_seq_len: cap on each request's KV cache (positions); None: the model's context.
        verbosity: the console's trace per request (quiet, summary, steps, full); its text only with log_prompts.
        startup_delay_s: sleep this long before loading (tests and the lesson watch /health say 503).
        keep_traces: how many finished requests' traces ``trace()`` remembers (oldest dropped).
        events: the bus GET /v1/events reads (``events.py``); default a ring of 4096 events.
        adapters: PEFT LoRA adapter folders merged into the weights at load (``minillm.load``'s
            ``adapters``); a folder that does not fit fails the load (GET /health: 503 with the error).
    """

    def __init__(
        self,
        model_name: str,
        *,
        metrics: ServerMetrics,
        served_name: str | None = None,
        max_queue: int = 64,
        request_timeout_s: float | None = None,
        max_seq_len: int | None = None,
        threads: int | None = None,
        warmup: bool = True,
        verbosity: str = "summary",
        log_prompts: bool = False,
        console=None,
        startup_delay_s: float = 0.0,
        keep_traces: int = 100,
        max_num_seqs: int = 16,
        kv_cache_mib: float = 512.0,
        max_batched_tokens: int = 512,
        block_size: int = 16,
        events: EventBus | None = None,
        guard: Guard | None = None,
        speculative: minillm.Speculative | None = None,
        adapters: list[str] | None = None,
    ):
        self.model_name, self.served_name = model_name, served_name or model_name
        self.adapters = list(adapters or [])  # LoRA folders merged into the weights at load
        self.speculative = speculative  # the default for requests that do not name a draft
        self.metrics, self.request_timeout_s, self.max_seq_len = metrics, request_timeout_s, max_seq_len
        self.threads, self.warmup, self.startup_delay_s = threads, warmup, startup_delay_s
        self.verbosity, self.console, self.log_prompts = verbosity, console, log_prompts
        self.model: minillm.Model | None = None
        self.status = "starting"  # starting -> loading -> ready | failed
        self.error: str | None = None
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.max_queue = max_queue
        self.max_num_seqs, self.kv_cache_mib = max_num_seqs, kv_cache_mib
        self.max_batched_tokens, self.block_size = max_batched_tokens, block_size
        self.pool: minillm.KVCachePool | None = None
        self.scheduler: Scheduler | None = None
        self.active: dict[int, Active] = {}  # request index -> its job, while it runs or waits to
        # Admission: a job out of the queue and not yet in the scheduler still waits. ``_admission``
        # makes the count and the move atomic (submit's check and put; the worker's take; its add).
        self._admission = threading.Lock()
        self._admitting: set[str] = set()  # ids of the jobs taken from the queue, not yet in the scheduler
        self._submitted = 0  # submit() calls (queued or refused): the test hook's "another request came"
        self._submits_at_take = 0  # _submitted when the job being admitted left the queue
        self._arrival = threading.Event()  # set by submit: a job was queued (wakes a waiting worker)
        self.calibration: dict | None = None  # the diagnosis's calibration, measured during the warm-up
        self.keep_traces = keep_traces
        self._ids = itertools.count()
        self._indices = itertools.count()  # the scheduler's request numbers
        self.events = events or EventBus()
        self.live = LiveFeed(self.events)  # builds events only while someone subscribes
        self.traces = TraceStore(keep_traces, on_record=self.live.finished)  # GET /v1/traces/{id}
        self.thread: threading.Thread | None = None
        self.guard = guard or Guard(metrics)  # fault isolation, backpressure, shutdown (reliability.py)

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self, model: minillm.Model | None = None) -> None:
        """Start the worker thread: load (and warm up) the model, then serve the queue. ``model``:
        serve this loaded model instead of loading ``model_name`` (tests, in one process)."""
        self.thread = threading.Thread(target=self._run, args=(model,), name="minillm-worker", daemon=True)
        self.thread.start()

    def _run(self, model: minillm.Model | None = None) -> None:
        self.status = "loading"
        self.live.load("loading", model=self.model_name)
        if self.startup_delay_s > 0:
            time.sleep(self.startup_delay_s)  # on purpose (--startup-delay); /health says so
        try:
            tracer = self._tracer()
            if model is None:
                how = {"warmup": False, "threads": self.threads, "progress": False, "adapters": self.adapters or None}
                model = minillm.load(self.model_name, tracer=tracer, **how)
            self.attach(model, tracer)
        except Exception as exc:  # noqa: BLE001 - reported by /health (503) rather than killing the server
            self.status, self.error = "failed", f"{type(exc).__name__}: {exc}"
            self.live.load("failed", error=self.error)
            return
        while True:
            self.serve_once(block=not self.scheduler.has_work())

    def attach(self, model: minillm.Model, tracer=None) -> None:
        """Serve ``model``: build the pool and the scheduler (warming up through the pool if asked);
        ``status`` becomes "ready". The thread calls it after loading; tests call it directly."""
        self.model = model
        self.pool = minillm.KVCachePool.for_model(model.config, self.kv_cache_mib, self.block_size)
        self.live.load("loaded", seconds=dict(model.load_seconds), blocks_total=self.pool.num_blocks)
        if self.warmup:  # through the pool requests will use: its memory is mapped on first write
            # a tracer's warm-up also measures what the requests' diagnosis reads (describe.warmup): the
            # machine's rates and the model's products rate, here and not inside a request's step
            tracer = tracer if tracer is not None else minillm.Tracer()
            run_warmup(model, tracer=tracer, pool=self.pool)
            self.calibration = next((e.data.get("calibration") for e in tracer.events if e.phase == "warmup"), None)
            self.live.load("warmup", seconds=model.warmup_s, calibration=self.calibration)
        self.scheduler = Scheduler(
            model, self.pool, max_batched_tokens=self.max_batched_tokens, max_num_seqs=self.max_num_seqs
        )
        self.status = "ready"
        self.live.load("ready", blocks_total=self.pool.num_blocks, bytes_per_block=self.pool.bytes_per_block)

    def serve_once(self, block: bool = False) -> None:
        """Move queued jobs into the batch (waiting for one if ``block``), run one step, send what
        it made. The worker thread calls it in a loop; tests call it to step the worker by hand."""
        self._take_jobs(block=block)
        pause = self.run_step()
        if pause > 0:  # only slow-motion requests run, all sitting out: wait (a new job ends it)
            self._take_jobs(block=True, timeout=pause)

    def run_step(self) -> float:
        """One scheduler step with its drain check, live events and answers (the registry's thread
        calls it for each loaded slot). Returns 0.0 when it stepped or had nothing to run, else the
        seconds until a slow-motion request is due (every running one sits out: nothing ran)."""
        self.guard.between_steps(a.request for a in self.active.values())
        if not self.scheduler.has_work():
            return 0.0
        pause = self.scheduler.seconds_until_ready()
        if pause > 0:
            return pause
        self.live.before_step(self.scheduler)
        try:
            self.scheduler.step()
        except Exception as exc:  # noqa: BLE001 - a bug: answer every client, keep the worker alive
            self._fail_all(exc)
        self.live.after_step(self)
        self._publish()
        return 0.0

    def served_names(self) -> list[str]:
        """The one name clients pass as ``model``."""
        return [self.served_name]

    def target(self, name: str) -> Worker | None:
        """This worker if ``name`` is its served name, else None."""
        return self if name == self.served_name else None

    def model_cards(self) -> list[dict]:
        """GET /v1/models' one entry, with ``adapters`` when LoRA adapters are merged (:meth:`adapter_card`)."""
        return [{"id": self.served_name, **self.adapter_card()}]

    def adapter_card(self) -> dict:
        """``{"adapters": names}`` of the LoRA adapters (the loaded ones', before the load, or unloaded, their
        folders' names), so a client sees which weights it is served; ``{}`` without adapters."""
        loaded = self.model.adapters if self.model is not None else []
        names = [a.name for a in loaded] or [Path(p).expanduser().resolve().name for p in self.adapters]
        return {"adapters": names} if names else {}

    def submit(self, job: Job) -> None:
        """Queue a job (arrival order). Raises QueueFullError when ``max_queue`` jobs already wait
        (counted in ``metrics.rejected``)."""
        try:
            with self._admission:  # the worker cannot take a job or add one to the scheduler meanwhile
                self._submitted += 1
                if self.waiting >= self.max_queue:
                    raise queue.Full
                self.queue.put_nowait(job)
                self._arrival.set()
        except queue.Full:
            self.metrics.rejected.inc()  # its final state: refused before any work
            n = self.max_queue
            raise QueueFullError(f"{n} request{' is' if n == 1 else 's are'} already waiting") from None
        self.live.queued(job)

    @property
    def context(self) -> int:
        """Positions a request may use: the model's context, capped by ``max_seq_len``."""
        ctx = self.model.config.max_position_embeddings
        return min(ctx, self.max_seq_len) if self.max_seq_len else ctx

    def _tracer(self) -> minillm.Tracer:
        return request_tracer(self.console, self.verbosity, self.log_prompts)

    # --- requests joining and leaving the batch -------------------------------------------------
    def _take_jobs(self, block: bool, timeout: float | None = None) -> None:
        """Move queued jobs into the scheduler (waiting for one when nothing runs, at most
        ``timeout`` seconds if given). A job taken from the queue counts as waiting until it is in
        the scheduler (or answered): ``--max-queue`` holds while a job is being prepared."""
        while True:
            with self._admission:  # out of the queue and into _admitting in one move (submit counts both)
                try:
                    job = self.queue.get_nowait()
                    self._admitting.add(job.request_id)
                    self._submits_at_take = self._submitted
                except queue.Empty:
                    job = None
                    self._arrival.clear()  # under the lock: a submit after this sets it again
            if job is None:
                if not block or not self._arrival.wait(timeout):
                    return
                block = False  # a job arrived: take it (and any others) without waiting again
                continue
            block = False
            try:
                self._admit(job)
            except Exception as exc:  # noqa: BLE001 - a bug: answer this client, keep the worker alive
                self.metrics.finished.labels(reason="error").inc()  # its final state: nothing else counted it
                self._answer_bug(job, self.guard.bug(job, "admission", exc), "in admission")
            finally:
                with self._admission:  # answered without entering the scheduler (or already moved: no-op)
                    self._admitting.discard(job.request_id)

    def _admit(self, job: Job) -> None:
        wait = time.perf_counter() - job.arrival
        self.metrics.queue_wait.observe(wait)
        if job.cancel.is_set():  # the client left while the request waited: no work at all
            cancelled = minillm.StopReason.CANCELLED
            self.traces.remember(job, cancelled, wait, [], note="client left while queued")
            self.metrics.finished.labels(reason=cancelled.value).inc()  # no token processed
            job.send("done", Outcome(text="", prompt_tokens=0, completion_tokens=0, stop_reason=cancelled,
                                     queue_wait_s=wait, ttft_s=None, logprobs=None))  # fmt: skip
            return
        tracer = self._tracer()
        if tracer.console is not None:
            key = f"key {job.owner}, " if job.owner else ""  # the key's label, never the key
            tracer.console.rule(f"request {job.request_id}  ({key}waited {wait * 1e3:.1f} ms in the queue)")
        try:
            prepared = prepare(self.model, job.prompt, chat=job.chat)  # rendered, tokenized once: the request takes it
            n_prompt = len(prepared[1])
            max_new = job.max_tokens or max(1, self.context - n_prompt)  # OpenAI's default: up to the context
            timeout = None
            if self.request_timeout_s is not None:  # the deadline counts from arrival: queue wait included
                timeout = max(self.request_timeout_s - wait, 1e-6)
            request = GuardedRequest(
                self.model,
                job.prompt,
                job.params if job.top_logprobs is None else replace(job.params, top_logprobs=job.top_logprobs),
                pool=self.pool,
                index=next(self._indices),
                max_new_tokens=max_new,
                chat=job.chat,
                listener=tracer,
                max_seq_len=max(1, min(self.context, n_prompt + max_new)),
                stop=job.stop,
                timeout_s=timeout,
                prepared=prepared,
                cancel=job.cancel,
                fault=job.fault,
                constraint=job.constraint,
                speculative=job.speculative,
                step_delay_s=job.slow_motion_s,
            )
            if job.fault is not None and job.fault["stage"] == "admission":
                hold_admission(job.fault, lambda: self._submitted != self._submits_at_take)
            with self._admission:  # in the scheduler and no longer being admitted, in one move
                self.scheduler.add(request)  # refuses a request the pool could never hold (400)
                self._admitting.discard(job.request_id)
        except minillm.MiniLLMError as exc:  # a request the runtime refuses: the client gets a 400
            self.traces.remember(job, None, wait, tracer.events, note=f"{type(exc).__name__}: {exc}")
            self.metrics.finished.labels(reason="refused").inc()
            job.send("error", exc)
            return
        self.active[request.index] = Active(job=job, request=request, tracer=tracer, wait=wait)

    def _publish(self) -> None:
        """Send each request's new text; answer the ones that finished."""
        for index, a in list(self.active.items()):
            for i in range(a.sent, len(a.request.deltas)) if not self.guard.shed(a) else ():
                a.job.send("delta", a.delta(i, self.model.tokenizer))
            a.sent = len(a.request.deltas)
            if a.request.result is not None:
                del self.active[index]
                try:
                    if (bug := self.guard.failure(a)) is None:
                        self._done(a)
                    else:  # it ended by a bug of its own: what it computed before the bug was computed
                        self.metrics.count_tokens(a.request)
                        self.metrics.finished.labels(reason="error").inc()  # its final state, as any other's
                        self._answer_bug(a.job, bug, f"in its {bug.stage}", a.wait, a.tracer.events)
                except Exception as exc:  # noqa: BLE001 - a bug answering it: that client gets a 500
                    self._answer_bug(a.job, self.guard.bug(a.job, "answer", exc), "in answer")

    def _answer_bug(self, job: Job, bug: MiniLLMBug, where: str, wait: float = 0.0, events: list = ()) -> None:
        """Answer ``job`` with minillm's bug (the HTTP layer's 500) and keep its trace saying where."""
        self.active = {i: a for i, a in self.active.items() if a.job is not job}
        self.traces.remember(job, None, wait, events, note=f"minillm bug {where}: {describe(bug.original)}")
        job.send("error", bug)

    def _fail_all(self, exc: Exception) -> None:
        for index, a in list(self.active.items()):
            del self.active[index]
            a.request.seq.reset()
            self.metrics.count_tokens(a.request)
            self.metrics.finished.labels(reason="error").inc()
            note = f"internal error {type(exc).__name__}: {exc}"
            self.traces.remember(a.job, None, a.wait, a.tracer.events, note=note)
            a.job.send("error", exc)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()

    def _done(self, a: Active) -> None:
        job, result, tracer, wait = a.job, a.request.result, a.tracer, a.wait
        m = result.metrics
        ttft = wait + m.ttft_s if result.ids and m.ttft_s is not None else None
        if not job.slow_motion_s:  # a slow-motion request's latencies are stretched on purpose: not counted
            self.metrics.observe_latencies(ttft, m.decode_step_s, time.perf_counter() - job.arrival)
        self.metrics.count_tokens(a.request)
        self.metrics.finished.labels(reason=result.stop_reason.value).inc()
        top = job.top_logprobs
        logprobs = lp.of_result(self.model.tokenizer, result, top) if top is not None else None
        self.traces.remember(job, result.stop_reason, wait, tracer.events)
        job.send("done", Outcome.of(result, job, wait, ttft, logprobs))

    def trace(self, request_id: str) -> dict | None:
        """The stored trace of a finished request, or None (unknown or already dropped)."""
        return self.traces.get(request_id)

    def next_id(self, prefix: str) -> str:
        """A request id unique in this process, e.g. ``chatcmpl-1a2b3c4d-0007``."""
        return f"{prefix}-{self.metrics.instance}-{next(self._ids):04d}"
