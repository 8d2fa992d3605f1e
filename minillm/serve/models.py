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

import itertools
import threading
import time

import minillm
from minillm.runtime.gguf_plan import gguf_weight_bytes
from minillm.runtime.memory_plan import (
    MemoryPlan,
    format_bytes,
    make_plan,
    measured_overhead,
    rss_bytes,
    trim_heap,
)

from .events import EventBus
from .metrics import LATENCY_BUCKETS, ServerMetrics
from .model_spec import ModelSpec, gguf_file
from .reliability import Guard
from .slot import ModelSlot
from .worker import Job

__all__ = ["SERVE_MODULES", "ModelRegistry", "ModelSlot", "ModelSpec"]
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "minillm.serve.app")


class ModelRegistry:
    """The served models, their plans, and the one thread that loads, evicts and steps them.

    Implements :class:`~minillm.serve.interface.ServedModels` for several models, as the single-model
    :class:`~minillm.serve.worker.Worker` does for one; ``slots``: served name -> :class:`ModelSlot`.

    Args:
        specs: the models, the first one loaded at start.
        budget: bytes all loaded models may hold together, the runtime included; None: no limit.
        keep_alive_s: seconds an idle model stays loaded (0: unload when idle; -1: never for idleness).
        max_loaded: models loaded at once; None: as many as the budget holds.
        kv_cache_mib: each model's pool; None: what the budget leaves that model alone (512 MiB without budget).
        guard: backpressure, fault isolation and the drain for every model (default: ``Guard(metrics)``).
        events: the one event stream of every model (default: a ring of 4096 events).
        speculative: the draft a request that names none gets, or None.
        worker_options: the :class:`~minillm.serve.worker.Worker` arguments every slot shares
            (max_num_seqs, block_size, ``adapters`` merged into every model at its load, ...).

    Raises:
        MemoryBudgetError: a model that cannot hold one full-context request within the budget
            (raised by :meth:`plan_all`, before any weight byte is read).
    """

    def __init__(self, specs, *, metrics: ServerMetrics, budget=None, keep_alive_s=-1.0, max_loaded=None,
                 kv_cache_mib=None, startup_delay_s=0.0, console=None, guard: Guard | None = None,
                 events: EventBus | None = None, speculative: minillm.Speculative | None = None,
                 **worker_options):  # fmt: skip
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
        self.guard, self.events = guard or Guard(metrics), events or EventBus()
        self.speculative = speculative
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
                spec, plan, on_submit=self.wake, metrics=self.metrics, console=self.console, guard=self.guard,
                events=self.events, **o,
            )  # fmt: skip
        return [s.plan for s in self.slots.values()]

    # --- what the HTTP layer reads (ServedModels) -------------------------------------------------
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
        """A finished request's kept trace, from whichever model served it; None if none has it."""
        return next((t for s in self.slots.values() if (t := s.trace(request_id)) is not None), None)

    def next_id(self, prefix: str) -> str:
        """A request id unique in this process (one counter for every model)."""
        return f"{prefix}-{self.metrics.instance}-{next(self._ids):04d}"

    def served_names(self) -> list[str]:
        """Every served name, the first model's first (known from the specs, before any plan)."""
        return [spec.served for spec in self.specs]

    def target(self, name: str) -> ModelSlot | None:
        """The slot of the model ``name`` names, or None."""
        return self.slots.get(name)

    # the Worker's gauges, each the sum over the slots (alive: this registry's one thread)
    running = property(lambda self: sum(s.running for s in self.slots.values()))
    waiting = property(lambda self: sum(s.waiting for s in self.slots.values()))
    kv_bytes_reserved = property(lambda self: sum(s.kv_bytes_reserved for s in self.slots.values()))
    kv_bytes_in_use = property(lambda self: sum(s.kv_bytes_in_use for s in self.slots.values()))
    blocks_used = property(lambda self: sum(s.blocks_used for s in self.slots.values()))
    blocks_total = property(lambda self: sum(s.blocks_total for s in self.slots.values()))
    tracked = property(lambda self: sum(s.tracked for s in self.slots.values()))
    alive = property(lambda self: self.thread is not None and self.thread.is_alive())

    @property
    def planned_bytes(self) -> int:
        """The runtime's bytes plus the plans of the loaded (or loading) models."""
        return self.runtime_bytes + sum(s.plan.model_bytes for s in self.slots.values() if s.state != "unloaded")

    def model_cards(self) -> list[dict]:
        """``/v1/models``' entries: state, readiness, weight dtype, resident bytes, last use (Unix s), and
        the LoRA ``adapters`` merged into it (``Worker.adapter_card``)."""
        return [
            {
                "id": name,
                "object": "model",
                "owned_by": "minillm",
                "state": s.state,
                "ready": s.state == "loaded",
                "weight_dtype": s.spec.weight_dtype,
                "resident_bytes": sum(s.resident.values()),
                "resident": s.resident,
                "planned_bytes": s.plan.model_bytes,
                "last_use": s.last_use,
                "loads": s.loads,
                **s.adapter_card(),
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
            worked, wait = False, 0.05  # idle: look again for keep-alive's expiry
            for slot in self.slots.values():
                if slot.state == "unloaded" and not slot.queue.empty():
                    self._load_on_demand(slot)
                if slot.state == "loaded" and (pause := slot.step()) is not None:
                    worked |= pause == 0.0
                    wait = min(wait, pause) if pause > 0 else wait  # slow motion: sleep until one is due
            self._expire()
            if busy and not worked:  # just gone idle: the steps' freed intermediates leave the resident set,
                trim_heap()  # so it is what the models hold (their plans), not what the last burst used
            busy = worked
            if not worked:  # nothing ran (idle, or every running request sits out): a new job wakes it
                self._wake.wait(timeout=wait)

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


_rss = rss_bytes  # this process's resident set in bytes (multi_server.py's plan route reads it too)
