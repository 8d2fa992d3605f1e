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

Only the public ``minillm`` API and the runtime's scheduler are used here.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import replace

import minillm
from minillm.runtime.loading import run_warmup
from minillm.runtime.scheduler import BatchRequest, Scheduler
from minillm.runtime.steps import prepare

from . import logprobs as lp
from .events import EventBus
from .jobs import Active, Job, Outcome, QueueFullError
from .live import LiveFeed
from .metrics import ServerMetrics
from .reliability import Guard, GuardedRequest

__all__ = ["Active", "Job", "Outcome", "QueueFullError", "Worker"]


class Worker:
    """Loads the model, then runs queued jobs together, a continuous batch, on its own thread.

    Args:
        model_name: a name from ``minillm models`` or a local folder.
        max_queue: how many requests may *wait* (running ones not counted); beyond: QueueFullError.
        max_num_seqs: requests running at once (the rest wait).
        kv_cache_mib: the paged KV-cache pool every running request's keys and values share.
        max_batched_tokens: tokens fed per step over all requests (prefill chunks + decode rows).
        block_size: positions per KV block.
        request_timeout_s: seconds from arrival (queue wait included) after which a request stops
            with StopReason.TIMEOUT; None: no limit.
        max_seq_len: cap on each request's KV cache (positions); None: the model's context.
        verbosity: the trace printed on ``console`` for every request (quiet, summary, steps, full).
        startup_delay_s: sleep this long before loading (tests and the lesson watch /health say 503).
        keep_traces: how many finished requests' traces ``trace()`` remembers (oldest dropped).
        events: the bus GET /v1/events reads (``events.py``); default a ring of 4096 events.
    """

    def __init__(
        self,
        model_name: str,
        *,
        metrics: ServerMetrics,
        max_queue: int = 64,
        request_timeout_s: float | None = None,
        max_seq_len: int | None = None,
        threads: int | None = None,
        warmup: bool = True,
        verbosity: str = "summary",
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
    ):
        self.model_name = model_name
        self.speculative = speculative  # the default for requests that do not name a draft
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.max_seq_len = max_seq_len
        self.threads = threads
        self.warmup = warmup
        self.verbosity = verbosity
        self.console = console
        self.startup_delay_s = startup_delay_s
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
        self.traces: OrderedDict[str, dict] = OrderedDict()
        self.keep_traces = keep_traces
        self._lock = threading.Lock()  # guards traces (written by the worker, read by the loop)
        self._ids = itertools.count()
        self._indices = itertools.count()  # the scheduler's request numbers
        self.events = events or EventBus()
        self.live = LiveFeed(self.events)  # builds events only while someone subscribes
        metrics.bind(self)
        self.thread: threading.Thread | None = None
        self.guard = guard or Guard(metrics)  # fault isolation, backpressure, shutdown (reliability.py)
        self.guard.counters.bind(self)

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
                model = minillm.load(self.model_name, tracer=tracer, warmup=False, threads=self.threads, progress=False)
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
        self.guard.between_steps(self)
        if self.scheduler.has_work():
            pause = self.scheduler.seconds_until_ready()
            if pause > 0:  # only slow-motion requests run, all sitting out: wait (a new job ends it)
                self._take_jobs(block=True, timeout=pause)
                return
            self.live.before_step(self.scheduler)
            try:
                self.scheduler.step()
            except Exception as exc:  # noqa: BLE001 - a bug: answer every client, keep the worker alive
                self._fail_all(exc)
            self.live.after_step(self)
            self._publish()

    @property
    def running(self) -> int:
        """Requests in the running batch."""
        return len(self.scheduler.running) if self.scheduler is not None else 0

    @property
    def waiting(self) -> int:
        """Requests waiting: in the queue, being admitted (taken from the queue, prepared, not yet in
        the scheduler), and in the scheduler but not yet running."""
        scheduled = len(self.scheduler.waiting) if self.scheduler is not None else 0
        return self.queue.qsize() + len(self._admitting) + scheduled

    @property
    def kv_bytes_reserved(self) -> int:
        """Bytes of the pool's blocks held by requests (a shared block counted once)."""
        return self.pool.num_used_blocks * self.pool.bytes_per_block if self.pool is not None else 0

    @property
    def kv_bytes_in_use(self) -> int:
        """Bytes holding the running requests' filled positions."""
        return sum(r.seq.used_bytes for r in self.scheduler.running) if self.scheduler is not None else 0

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
        console = self.console if self.verbosity != "quiet" else None
        return minillm.Tracer(console, verbosity=self.verbosity, live=False)

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
                self.guard.bug(self, job, "admission", exc)
            finally:
                with self._admission:  # answered without entering the scheduler (or already moved: no-op)
                    self._admitting.discard(job.request_id)

    def _admit(self, job: Job) -> None:
        wait = time.perf_counter() - job.arrival
        self.metrics.queue_wait.observe(wait)
        if job.cancel.is_set():  # the client left while the request waited: no work at all
            self._remember(job, minillm.StopReason.CANCELLED, wait, [], note="client left while queued")
            self.metrics.finished.labels(reason=minillm.StopReason.CANCELLED.value).inc()  # no token processed
            job.send("done", Outcome("", 0, 0, minillm.StopReason.CANCELLED, wait, None, None))
            return
        tracer = self._tracer()
        if tracer.console is not None:
            tracer.console.rule(f"request {job.request_id}  (waited {wait * 1e3:.1f} ms in the queue)")
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
                self._hold_admission(job.fault)
            with self._admission:  # in the scheduler and no longer being admitted, in one move
                self.scheduler.add(request)  # refuses a request the pool could never hold (400)
                self._admitting.discard(job.request_id)
        except minillm.MiniLLMError as exc:  # a request the runtime refuses: the client gets a 400
            self._remember(job, None, wait, tracer.events, note=f"{type(exc).__name__}: {exc}")
            self.metrics.finished.labels(reason="refused").inc()
            job.send("error", exc)
            return
        self.active[request.index] = Active(job, request, tracer, wait)

    def _hold_admission(self, fault: dict) -> None:
        """``--test-faults``' admission stage (``reliability.py``): keep this job taken from the queue and
        not yet in the scheduler until another request reaches :meth:`submit` (queued or refused) after
        it left the queue, at most ``fault["hold_s"]`` seconds: the window in which ``--max-queue`` must
        still count it."""
        deadline = time.monotonic() + fault.get("hold_s", 30.0)
        while self._submitted == self._submits_at_take and time.monotonic() < deadline:
            time.sleep(0.005)

    def _publish(self) -> None:
        """Send each request's new text; answer the ones that finished."""
        for index, a in list(self.active.items()):
            for delta in a.request.deltas[a.sent :] if not self.guard.shed(a) else ():
                a.job.send("delta", delta)
            a.sent = len(a.request.deltas)
            if a.request.result is not None:
                del self.active[index]
                try:
                    if not self.guard.failed(self, a):
                        self._done(a)
                except Exception as exc:  # noqa: BLE001 - a bug answering it: that client gets a 500
                    self.guard.bug(self, a.job, "answer", exc)

    def _fail_all(self, exc: Exception) -> None:
        for index, a in list(self.active.items()):
            del self.active[index]
            a.request.seq.reset()
            self._count_tokens(a.request)
            self.metrics.finished.labels(reason="error").inc()
            self._remember(a.job, None, a.wait, a.tracer.events, note=f"internal error {type(exc).__name__}: {exc}")
            a.job.send("error", exc)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()

    def _done(self, a: Active) -> None:
        job, result, tracer, wait = a.job, a.request.result, a.tracer, a.wait
        m = result.metrics
        ttft = wait + m.ttft_s if result.ids and m.ttft_s is not None else None
        timed = not job.slow_motion_s  # a slow-motion request's latencies are stretched on purpose: not counted
        if ttft is not None and timed:
            self.metrics.ttft.observe(ttft)
        for step in m.decode_step_s if timed else ():
            self.metrics.tpot.observe(step)
        if timed:
            self.metrics.e2e.observe(time.perf_counter() - job.arrival)
        self._count_tokens(a.request)
        self.metrics.finished.labels(reason=result.stop_reason.value).inc()
        logprobs = self._logprobs(result, job.top_logprobs) if job.top_logprobs is not None else None
        self._remember(job, result.stop_reason, wait, tracer.events)
        job.send(
            "done",
            Outcome(
                result.text,
                len(result.prompt_ids),
                len(result.ids),
                result.stop_reason,
                wait,
                ttft,
                logprobs,
                m.cached_prompt_tokens,
                job.load_s,
                result.incomplete,
                {k: getattr(m, k) for k in ("target_passes", "drafted_tokens", "accepted_tokens")}
                if m.speculative_k
                else None,
            ),
        )

    def _count_tokens(self, request: BatchRequest) -> None:
        """Count the prompt tokens the model computed (prefix-cache hits and a request that never
        ran: none) and the tokens it sampled."""
        self.metrics.prompt_tokens.inc(request.metrics.prompt_tokens_computed)
        self.metrics.generation_tokens.inc(len(request.new_ids))

    def _remember(self, job: Job, reason, wait: float, events: list, note: str | None = None) -> None:
        """Keep the request's trace for GET /v1/traces/{id} (the newest ``keep_traces`` only)."""
        record = {
            "id": job.request_id,
            "stop_reason": reason.value if reason is not None else "error",
            "queue_wait_s": wait,
            "note": note,
            "slow_motion_s": job.slow_motion_s,  # seconds it sat out after each step (not in the metrics)
            "events": [_event_dict(e) for e in events],
        }
        with self._lock:
            self.traces[job.request_id] = record
            while len(self.traces) > self.keep_traces:
                self.traces.popitem(last=False)
        self.live.finished(record)

    def trace(self, request_id: str) -> dict | None:
        """The stored trace of a finished request, or None (unknown or already dropped)."""
        with self._lock:
            return self.traces.get(request_id)

    # --- logprobs ------------------------------------------------------------------------------
    def _logprobs(self, result, top: int) -> list[dict]:
        """One entry per output token (a stopping EOS left out) in OpenAI's shape (``logprobs.py``:
        each token's own bytes), from the numbers the sampler drew with (``result.logprobs``,
        ``SamplingParams.top_logprobs``: after the bias, penalties, mask, temperature, top-k, top-p,
        min-p; at temperature 0, the distribution at temperature 1)."""
        ids = result.ids[:-1] if result.stop_reason is minillm.StopReason.EOS else result.ids
        steps = [(s["id"], math.exp(s["logprob"]), [(i, math.exp(q)) for i, q in s["top"]]) for s in result.logprobs]
        return lp.content(self.model.tokenizer, steps, ids, top)

    def next_id(self, prefix: str) -> str:
        """A request id unique in this process, e.g. ``chatcmpl-1a2b3c4d-0007``."""
        return f"{prefix}-{self.metrics.instance}-{next(self._ids):04d}"


def _event_dict(event) -> dict:
    """A TraceEvent as plain JSON data; NaN (e.g. TPOT of a one-token request) becomes None,
    because strict JSON, which HTTP responses use, has no NaN."""
    import json

    return _finite(json.loads(event.to_json()))


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
