"""One model of a several-model server (``models.py``): a :class:`~minillm.serve.worker.Worker`
without a thread of its own, that the registry's thread loads, steps and unloads.

Its queue, scheduler, traces and answers are the single-model server's code; what it adds is
its plan (the KV pool's size and the context), the load's phases (seconds, read by the waiting
requests' traces) and whether it is idle (what eviction may take).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import minillm
from minillm.observe.events import TraceEvent
from minillm.runtime.loading import run_warmup
from minillm.runtime.memory_plan import MIB, MemoryPlan, trim_heap
from minillm.runtime.scheduler import Scheduler

from .model_spec import ModelSpec
from .worker import Job, Worker


class ModelSlot(Worker):
    """One model's queue, scheduler and traces; loaded and unloaded by the registry's thread.

    Args:
        spec: the model and its weight dtype, under the name clients pass.
        plan: its memory plan (``memory_plan.py``): the KV pool's size, the context.
        on_submit: called after a job is queued (the registry's thread wakes to load or step it).
        worker_options: the :class:`~minillm.serve.worker.Worker` arguments (metrics, guard, events, ...).
    """

    def __init__(self, spec: ModelSpec, plan: MemoryPlan, *, on_submit: Callable[[], None], **worker_options):
        super().__init__(spec.source, served_name=spec.served, **worker_options)
        self.spec, self.plan, self.on_submit = spec, plan, on_submit
        self.state = "unloaded"  # unloaded -> loading -> loaded -> unloaded ...
        self.last_use: float | None = None  # time.time() of the last step or load
        self.loads = 0
        self.last_load: dict | None = None  # phases (s), evicted, reason: what the waiting requests' traces show

    @property
    def context(self) -> int:
        return self.plan.context

    def submit(self, job: Job) -> None:
        super().submit(job)
        self.on_submit()  # wakes the registry's thread

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
        self._phase("loading")
        t0 = time.perf_counter()
        how = {"threads": self.threads, "weight_dtype": self.spec.weight_dtype, "adapters": self.adapters or None}
        self.model = minillm.load(self.spec.source, warmup=False, progress=False, **how)
        t1 = time.perf_counter()
        ws = self.model.transformer.weights.seconds
        read = ws.get("read", 0.0) + ws.get("map", 0.0)
        convert = sum(v for k, v in ws.items() if k not in ("read", "map"))
        self.pool = minillm.KVCachePool.for_model(self.model.config, self.plan.kv_pool / MIB, self.block_size)
        self.pool.keys.fill(0)  # commit every page now: the pool is resident as planned, not on first write
        self.pool.values.fill(0)
        t2 = time.perf_counter()
        self._phase("loaded", seconds=dict(self.model.load_seconds), blocks_total=self.pool.num_blocks)
        if self.warmup:  # a tracer's warm-up also measures the diagnosis's rates (describe.warmup), not a step
            tracer = minillm.Tracer()
            run_warmup(self.model, tracer=tracer, pool=self.pool)
            self.calibration = next((e.data.get("calibration") for e in tracer.events if e.phase == "warmup"), None)
            self._phase("warmup", seconds=self.model.warmup_s, calibration=self.calibration)
        trim_heap()  # the load's temporaries (float32 rows before int8, file buffers) leave the resident set
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
        self._phase("ready", blocks_total=self.pool.num_blocks, bytes_per_block=self.pool.bytes_per_block)
        for job in list(self.queue.queue):  # the requests that waited for this load
            job.load_s = t3 - t0
        return phases

    def _phase(self, phase: str, **facts) -> None:
        """A ``load`` event on the live page's stream, naming this model (the one-model worker's phases,
        and ``unloaded`` when the registry evicts it)."""
        self.live.load(phase, model=self.spec.served, **facts)

    def unload(self) -> None:
        """Drop the model, its pool and scheduler (only ever called when idle)."""
        held = self.guard.token_bytes  # the prompt check's (tokenizer, longest token) would keep it alive
        if held is not None and self.model is not None and held[0] is self.model.tokenizer:
            self.guard.token_bytes = None  # (an evicted model's tokenizer, which no plan counts any more)
        self.model = self.pool = self.scheduler = None
        self.state, self.status = "unloaded", "unloaded"
        self._phase("unloaded")
        gc.collect()
        trim_heap()

    def step(self) -> float | None:
        """Take queued jobs and run one step as the one-model worker does (``Worker.run_step``: the
        drain's cancel, the live events, the answers). Returns None when there was nothing to run,
        0.0 when it stepped, else seconds until a slow-motion request is due (nothing ran)."""
        self._take_jobs(block=False)
        if not self.scheduler.has_work():
            return None
        pause = self.run_step()
        if pause == 0.0:
            self.last_use = time.time()
        return pause

    def _admit(self, job: Job) -> None:
        super()._admit(job)
        if job.load_s and self.last_load is not None:  # the load it waited for, as the first phase of its trace
            for a in self.active.values():
                if a.job is job:
                    facts = {"model": self.spec.served, **self.last_load}
                    a.tracer.events.insert(0, TraceEvent("model_load", 0.0, job.load_s, facts))
