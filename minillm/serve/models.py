"""Several models behind one server: a memory plan before every load, LRU eviction, keep-alive.

    minillm serve A --model B --model B:int8 --memory-budget 2GiB --keep-alive 300

Design: ONE worker thread for all models, switching between them. Every model has a
:class:`ModelSlot` (a :class:`~minillm.serve.worker.Worker` that never starts a thread of its
own: its queue, scheduler, traces and answers are the single-model server's code), and the
registry's thread drives them::

    loop:  for each slot: queued jobs but unloaded -> make room (evict LRU idle slots) -> load
                          loaded -> take its jobs, one scheduler step, publish
           idle slots past --keep-alive -> unload

Why one thread and not one per model: every load, unload and step then happens on the thread
that owns the arrays, so an eviction can never race a request that is just arriving, and
"idle" (queue empty, nothing running) is read where it is decided. The cost: while B loads,
A's running streams pause (they are not cut); on two cores a second thread would compete for
the same cores anyway. Only idle models are evicted, so a running stream is never cut: a
request for B waits in B's queue until A's requests end.

The budget counts each loaded model's plan (``memory_plan.py``: weights, KV pool, activations,
tokenizer) plus the runtime's own bytes once. ``--keep-alive -1``: idleness never unloads it (the budget may).
"""

from __future__ import annotations

import gc
import itertools
import threading
import time

import minillm
from minillm.observe.events import TraceEvent
from minillm.runtime.gguf_plan import gguf_weight_bytes
from minillm.runtime.loading import run_warmup
from minillm.runtime.memory_plan import (
    MIB,
    MemoryPlan,
    format_bytes,
    make_plan,
    measured_overhead,
    rss_bytes,
    trim_heap,
)
from minillm.runtime.scheduler import Scheduler

from .events import EventBus
from .metrics import LATENCY_BUCKETS, ServerMetrics
from .model_spec import ModelSpec, gguf_file
from .reliability import Guard
from .worker import Job, Worker

SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "minillm.serve.app")


class ModelSlot(Worker):
    """One model's queue, scheduler and traces; loaded and unloaded by the registry's thread."""

    def __init__(self, spec: ModelSpec, plan: MemoryPlan, registry: ModelRegistry, **worker_options):
        super().__init__(spec.source, **worker_options)
        self.spec, self.plan, self.registry = spec, plan, registry
        self.state = "unloaded"  # unloaded -> loading -> loaded -> unloaded ...
        self.last_use: float | None = None  # time.time() of the last step or load
        self.loads = 0
        self.last_load: dict | None = None  # phases (s), evicted, reason: what the waiting requests' traces show

    @property
    def context(self) -> int:
        return self.plan.context

    def submit(self, job: Job) -> None:
        super().submit(job)
        self.registry.wake()

    @property
    def idle(self) -> bool:
        """Loaded, nothing queued, nothing running or waiting in the scheduler."""
        return self.state == "loaded" and self.queue.empty() and not self.active

    @property
    def resident(self) -> dict[str, int]:
        """Bytes held now, by kind: ``weights`` and ``kv_pool`` (0 when unloaded)."""
        if self.model is None or self.pool is None:
            return {"weights": 0, "kv_pool": 0}
        return {"weights": self.model.transformer.weights.nbytes, "kv_pool": self.pool.nbytes}

    def load(self, evicted: list[tuple[str, str]]) -> dict[str, float]:
        """Load, commit the KV pool, warm up; returns seconds by phase. Raises what ``minillm.load`` raises.

        The ``warmup`` phase includes what the requests' diagnosis reads, measured there rather than in
        a request's step: this model's products rate and, at the first load only, the machine's rates."""
        self.state = "loading"
        t0 = time.perf_counter()
        self.model = minillm.load(
            self.spec.source, warmup=False, threads=self.threads, progress=False, weight_dtype=self.spec.weight_dtype
        )
        t1 = time.perf_counter()
        ws = self.model.transformer.weights.seconds
        read = ws.get("read", 0.0) + ws.get("map", 0.0)
        convert = sum(v for k, v in ws.items() if k not in ("read", "map"))
        self.pool = minillm.KVCachePool.for_model(self.model.config, self.plan.kv_pool / MIB, self.block_size)
        self.pool.keys.fill(0)  # commit every page now: the pool is resident as planned, not on first write
        self.pool.values.fill(0)
        t2 = time.perf_counter()
        if self.warmup:  # a tracer's warm-up also measures the diagnosis's rates (describe.warmup), not a step
            tracer = minillm.Tracer()
            run_warmup(self.model, tracer=tracer, pool=self.pool)
            self.calibration = next((e.data.get("calibration") for e in tracer.events if e.phase == "warmup"), None)
        _trim_heap()  # the load's temporaries (float32 rows before int8, file buffers) leave the resident set
        t3 = time.perf_counter()
        self.scheduler = Scheduler(
            self.model, self.pool, max_batched_tokens=self.max_batched_tokens, max_num_seqs=self.max_num_seqs
        )
        phases = {"read": read, "convert": convert, "other": (t1 - t0) - read - convert}
        phases |= {"kv_pool": t2 - t1, "warmup": t3 - t2}
        self.state, self.status, self.loads, self.last_use = "loaded", "ready", self.loads + 1, time.time()
        self.last_load = {
            "seconds": phases,
            "load_s": t3 - t0,
            "evicted": [{"model": m, "reason": r} for m, r in evicted],
        }
        for job in list(self.queue.queue):  # the requests that waited for this load
            job.load_s = t3 - t0
        return phases

    def unload(self) -> None:
        """Drop the model, its pool and scheduler (only ever called when idle)."""
        held = self.guard.token_bytes  # the prompt check's (tokenizer, longest token) would keep it alive
        if held is not None and self.model is not None and held[0] is self.model.tokenizer:
            self.guard.token_bytes = None  # (an evicted model's tokenizer, which no plan counts any more)
        self.model = self.pool = self.scheduler = None
        self.state, self.status = "unloaded", "unloaded"
        gc.collect()
        _trim_heap()

    def step(self) -> bool:
        """Take queued jobs and run one scheduler step; returns whether there was work."""
        self._take_jobs(block=False)
        if not self.scheduler.has_work():
            return False
        try:
            self.scheduler.step()
        except Exception as exc:  # noqa: BLE001 - a bug: answer every client, keep the server alive
            self._fail_all(exc)
        self._publish()
        self.last_use = time.time()
        return True

    def _admit(self, job: Job) -> None:
        super()._admit(job)
        if job.load_s and self.last_load is not None:  # the load it waited for, as the first phase of its trace
            for a in self.active.values():
                if a.job is job:
                    facts = {"model": self.spec.served, **self.last_load}
                    a.tracer.events.insert(0, TraceEvent("model_load", 0.0, job.load_s, facts))


class _SlotSum:
    """A read-only attribute of the registry: the sum of the same-named attribute over its slots (an int)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, registry, owner=None) -> int:
        return sum(getattr(s, self.name) for s in registry.slots.values())


class ModelRegistry:
    """The served models, their plans, and the one thread that loads, evicts and steps them.

    Duck-types the single-model :class:`Worker` where the HTTP layer reads it (``status``,
    ``metrics``, ``submit``, ``trace``, ``next_id``), plus ``slots`` (served name -> slot).

    Args:
        specs: the models, the first one loaded at start.
        budget: bytes all loaded models may hold together, the runtime included; None: no limit.
        keep_alive_s: seconds an idle model stays loaded (0: unload when idle; -1: never for idleness).
        max_loaded: models loaded at once; None: as many as the budget holds.
        kv_cache_mib: each model's pool; None: what the budget leaves that model alone (512 MiB without budget).
        worker_options: the :class:`Worker` arguments every slot shares (max_num_seqs, block_size, ...).

    Raises:
        MemoryBudgetError: a model that cannot hold one full-context request within the budget
            (raised by :meth:`plan_all`, before any weight byte is read).
    """

    def __init__(self, specs, *, metrics: ServerMetrics, budget=None, keep_alive_s=-1.0, max_loaded=None,
                 kv_cache_mib=None, startup_delay_s=0.0, console=None, **worker_options):  # fmt: skip
        self.specs, self.metrics, self.budget = list(specs), metrics, budget
        self.keep_alive_s, self.max_loaded, self.kv_cache_mib = keep_alive_s, max_loaded, kv_cache_mib
        self.startup_delay_s, self.console, self.options = startup_delay_s, console, worker_options
        self.keep_traces = worker_options.get("keep_traces", 100)
        self.slots: dict[str, ModelSlot] = {}
        self.status, self.error = "starting", None
        self.runtime_bytes = 0
        self.switches = 0
        self._wake = threading.Event()
        self._ids = itertools.count()
        self.thread: threading.Thread | None = None
        # one guard (fault isolation, backpressure, shutdown) and one event stream for every model
        self.guard, self.events, self.speculative = Guard(metrics), EventBus(), None
        self._metrics()

    # --- the plan, before anything loads -------------------------------------------------------
    def plan_all(self) -> list[MemoryPlan]:
        """Each model's plan from its config and tokenizer, read without its weights (``plan_files.py``)."""
        from minillm.model.config import ModelConfig
        from minillm.sources.plan_files import plan_folder

        # config.json and the tokenizer only (sources/plan_files.py); a model whose config is only in
        # its GGUF (an offline source not fetched yet) has the GGUF fetched and its header read, not converted
        folders = {s.served: plan_folder(s.source, progress=True) for s in self.specs}
        measured = measured_overhead(list(folders.values()), SERVE_MODULES)
        self.runtime_bytes = measured["runtime"]
        o = self.options
        for spec in self.specs:
            config = ModelConfig.from_folder(folders[spec.served])
            packed = gguf_weight_bytes(gguf_file(spec.source), config) if spec.weight_dtype == "gguf" else None
            plan = make_plan(
                config, model=spec.served, weight_dtype=spec.weight_dtype, context=o.get("max_seq_len"),
                max_num_seqs=o.get("max_num_seqs", 16), max_batched_tokens=o.get("max_batched_tokens", 512),
                block_size=o.get("block_size", 16), kv_cache_mib=self.kv_cache_mib, budget=self.budget,
                tokenizer=measured["tokenizers"][str(folders[spec.served])], runtime=self.runtime_bytes,
                weights=packed,
            )  # fmt: skip
            self.slots[spec.served] = ModelSlot(
                spec, plan, self, metrics=self.metrics, console=self.console, guard=self.guard, events=self.events, **o
            )
        self.metrics.bind(self)  # the gauges read the registry (each slot's Worker bound itself)
        self._bind_guard()
        return [s.plan for s in self.slots.values()]

    # --- what the HTTP layer reads --------------------------------------------------------------
    def _bind_guard(self) -> None:
        """The reliability gauges (one guard for the server) read every slot, and this thread."""
        c, slots = self.guard.counters, self.slots.values()
        c.blocks_used.set_function(lambda: sum(s.pool.num_used_blocks for s in slots if s.pool is not None))
        c.blocks_total.set_function(lambda: sum(s.pool.num_blocks for s in slots if s.pool is not None))
        c.tracked.set_function(lambda: sum(len(s.active) for s in slots))
        c.worker_alive.set_function(lambda: float(self.thread is not None and self.thread.is_alive()))

    def start(self) -> None:
        """Start the thread: load the first model, then serve every model's queue."""
        self.thread = threading.Thread(target=self._run, name="minillm-models", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        self._wake.set()

    def submit(self, job: Job) -> None:
        """Queue ``job`` on its model's slot (``job.model``). Raises QueueFullError."""
        self.slots[job.model].submit(job)

    def trace(self, request_id: str) -> dict | None:
        return next((t for s in self.slots.values() if (t := s.trace(request_id)) is not None), None)

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{self.metrics.instance}-{next(self._ids):04d}"

    # the Worker's gauges, each the sum over the slots: requests running and waiting, KV bytes reserved and in use
    running = _SlotSum()
    waiting = _SlotSum()
    kv_bytes_reserved = _SlotSum()
    kv_bytes_in_use = _SlotSum()

    @property
    def planned_bytes(self) -> int:
        """The runtime's bytes plus the plans of the loaded (or loading) models."""
        return self.runtime_bytes + sum(s.plan.model_bytes for s in self.slots.values() if s.state != "unloaded")

    def model_cards(self) -> list[dict]:
        """``/v1/models``' entries: state, readiness, weight dtype, resident bytes, last use (Unix s)."""
        return [
            {
                "id": name,
                "object": "model",
                "owned_by": "minillm",
                "created": int(time.time()),
                "state": s.state,
                "ready": s.state == "loaded",
                "weight_dtype": s.spec.weight_dtype,
                "resident_bytes": sum(s.resident.values()),
                "resident": s.resident,
                "planned_bytes": s.plan.model_bytes,
                "last_use": s.last_use,
                "loads": s.loads,
            }  # fmt: skip
            for name, s in self.slots.items()
        ]

    # --- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        self.status = "loading"
        if self.startup_delay_s > 0:
            time.sleep(self.startup_delay_s)  # on purpose (--startup-delay); /health says so
        first = self.slots[self.specs[0].served]
        try:
            self._load(first, [], on_demand=False)
        except Exception as exc:  # noqa: BLE001 - reported by /health (503) rather than killing the server
            self.status, self.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        self.status = "ready"
        busy = False
        while True:
            self._wake.clear()
            worked = False
            for slot in self.slots.values():
                if slot.state == "unloaded" and not slot.queue.empty():
                    self._load_on_demand(slot)
                if slot.state == "loaded":
                    worked |= slot.step()
            self._expire()
            if busy and not worked:  # just gone idle: the steps' freed intermediates leave the resident set,
                _trim_heap()  # so it is what the models hold (their plans), not what the last burst used
            busy = worked
            if not worked:
                self._wake.wait(timeout=0.05)

    def _load_on_demand(self, slot: ModelSlot) -> None:
        evicted = self._make_room(slot)
        if evicted is None:
            return  # no idle model to evict yet: the request waits in the queue
        try:
            self._load(slot, evicted, on_demand=True)
        except Exception as exc:  # noqa: BLE001 - its requests get the error; the server keeps serving
            slot.unload()
            slot.error = f"{type(exc).__name__}: {exc}"
            while not slot.queue.empty():
                slot.queue.get_nowait().send("error", exc)

    def _make_room(self, slot: ModelSlot) -> list[tuple[str, str]] | None:
        """Evict least recently used idle models until ``slot`` fits; None: it cannot fit yet."""
        evicted: list[tuple[str, str]] = []
        while True:
            loaded = [s for s in self.slots.values() if s.state == "loaded"]
            over_budget = self.budget is not None and self.planned_bytes + slot.plan.model_bytes > self.budget
            too_many = self.max_loaded is not None and len(loaded) >= self.max_loaded
            if not (over_budget or too_many):
                return evicted
            idle = sorted((s for s in loaded if s.idle), key=lambda s: s.last_use or 0.0)
            if not idle:
                return None
            reason = "memory budget" if over_budget else "max loaded models"
            self._evict(idle[0], reason, f"to load {slot.spec.served}")
            evicted.append((idle[0].spec.served, reason))

    def _evict(self, slot: ModelSlot, reason: str, why: str) -> None:
        slot.unload()
        self._evictions.labels(model=slot.spec.served, reason=reason).inc()
        self._say(f"[yellow]evicted[/] {slot.spec.served} ({reason}: {why})")

    def _expire(self) -> None:
        if self.keep_alive_s < 0:
            return
        now = time.time()
        for slot in self.slots.values():
            if slot.idle and now - (slot.last_use or now) >= self.keep_alive_s:
                self._evict(slot, "keep-alive", f"idle for {self.keep_alive_s:g} s")

    def _load(self, slot: ModelSlot, evicted: list, on_demand: bool) -> None:
        self._say(f"loading {slot.spec.served} ({slot.spec.weight_dtype}, plan {format_bytes(slot.plan.total)})")
        phases = slot.load(evicted)
        for phase, seconds in phases.items():
            self._load_seconds.labels(model=slot.spec.served, phase=phase).observe(seconds)
        self._loads.labels(model=slot.spec.served).inc()
        if on_demand:
            self._switches.inc()
        self._say(f"loaded {slot.spec.served} in {sum(phases.values()):.2f} s; measured RSS {format_bytes(_rss())}")

    def _say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(f"minillm serve: {text}")

    # --- metrics ----------------------------------------------------------------------------------
    def _metrics(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        r = self.metrics.registry
        self._load_seconds = Histogram(
            "minillm_model_load_seconds", "Model load time by phase (s)", ["model", "phase"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self._loads = Counter("minillm_model_loads", "Model loads", ["model"], registry=r)
        self._switches = Counter(
            "minillm_model_switches", "Loads on demand (a request named an unloaded model)", registry=r
        )
        self._evictions = Counter(
            "minillm_model_evictions", "Models unloaded, by reason", ["model", "reason"], registry=r
        )
        self._resident = Gauge(
            "minillm_model_resident_bytes", "Bytes a model holds, by kind", ["model", "kind"], registry=r
        )
        planned = Gauge("minillm_memory_planned_bytes", "Runtime + the loaded models' plans", registry=r)
        planned.set_function(lambda: self.planned_bytes)
        measured = Gauge("minillm_memory_measured_bytes", "The server process's resident set (RSS)", registry=r)
        measured.set_function(_rss)
        for spec in self.specs:
            for kind in ("weights", "kv_pool"):
                gauge = self._resident.labels(model=spec.served, kind=kind)
                gauge.set_function(lambda n=spec.served, k=kind: self.slots[n].resident[k] if n in self.slots else 0)


_trim_heap = trim_heap  # a load's temporaries and a freed tokenizer's small objects leave the resident set
_rss = rss_bytes  # this process's resident set in bytes (multi_server.py's plan route reads it too)
