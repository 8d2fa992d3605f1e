"""One Ray Serve replica: one loaded, warmed model behind the same FastAPI app as ``minillm serve``.

constructor     load (the load plan's phases), warm up through the paged pool, then return:
                Ray routes nothing to a replica before its constructor returns, so ready = warmed
HTTP            Ray's proxy -> this replica's FastAPI app (``serve.app.create_app``), unchanged
relay(scope, body)   the same app called in-process, for the prefix router's ingress (app.py)
record_routing_stats  what the router reads: this pool's cached block hashes and its load
__del__         Ray stops a replica after its ongoing requests end (graceful shutdown); the
                guard's drain then refuses new ones and waits for the streams still in flight
"""

from __future__ import annotations

import asyncio
import time

from rich.console import Console

from minillm.serve.app import create_app
from minillm.serve.auth import Access, KeyRing
from minillm.serve.events import EventBus
from minillm.serve.metrics import ServerMetrics
from minillm.serve.reliability import Guard
from minillm.serve.worker import Worker

from .config import DeployConfig
from .metrics import labelled


class ReplicaWorker(Worker):
    """A :class:`~minillm.serve.worker.Worker` started by the replica's constructor (with the model it
    loaded there), so the app's lifespan start finds it running and starts nothing twice."""

    def start(self, model=None) -> None:
        if self.thread is None:
            super().start(model)


class ReplicaMetrics(ServerMetrics):
    """The server's metrics, each sample labelled ``replica="<Ray's replica id>"``."""

    def __init__(self, replica: str):
        super().__init__()
        self.replica = replica

    def render(self) -> bytes:
        return labelled(super().render(), self.replica)


class Tagged:
    """An ASGI app's answers with ``x-minillm-replica``, ``x-minillm-weight-dtype`` and ``x-minillm-adapters``
    headers: which replica answered, holding which weights, with which LoRA adapters merged (their names,
    comma-separated; ``none``): a client sees the fleet, and a rolling update is visible."""

    def __init__(self, app, replica: str, weight_dtype: str, adapters: list[str] = ()):
        self.app = app
        self.headers = [(b"x-minillm-replica", replica.encode()), (b"x-minillm-weight-dtype", weight_dtype.encode()),
                        (b"x-minillm-adapters", (",".join(adapters) or "none").encode())]  # fmt: skip

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), *self.headers])
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


class MiniLLMReplica:
    """The deployment's class: ``settings`` is :class:`~minillm.deploy.config.DeployConfig` as a dict.

    Raises (from the constructor, so Ray marks the replica failed and starts no traffic to it):
        RuntimeError: the model failed to load or warm up (the worker's error).
    """

    def __init__(self, settings: dict):
        from ray import serve

        import minillm

        self.config = config = DeployConfig.from_args(settings)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        console = Console(highlight=False, width=120)
        self.metrics = metrics = ReplicaMetrics(self.replica_id)
        self.worker = ReplicaWorker(
            config.model,
            metrics=metrics,
            threads=config.threads,
            max_seq_len=config.max_seq_len,
            max_num_seqs=config.max_num_seqs,
            kv_cache_mib=config.kv_cache_mib,
            block_size=config.block_size,
            max_queue=4 * config.max_ongoing_requests,
            verbosity="quiet",
            console=console,
            events=EventBus(log=console.print),
            guard=Guard(metrics),
            adapters=config.adapters,
        )
        t0 = time.perf_counter()
        how = {"threads": config.threads, "warmup": False, "progress": False, "adapters": config.adapters or None}
        model = minillm.load(config.model, weight_dtype=config.weight_dtype, **how)  # adapters merged at load
        self.worker.start(model)  # warms up through the pool on its thread, then serves
        while self.worker.status not in ("ready", "failed"):
            time.sleep(0.05)
        if self.worker.status == "failed":
            raise RuntimeError(f"replica {self.replica_id}: {self.worker.error}")
        adapters = [a.name for a in model.adapters]
        self.load = {
            "replica": self.replica_id,
            "weight_dtype": config.weight_dtype,
            "adapters": adapters,
            "phases_s": {**model.load_seconds, "warmup": model.warmup_s},
            "ready_after_s": time.perf_counter() - t0,
        }
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in self.load["phases_s"].items())
        held = config.weight_dtype + "".join(f", adapter {name}" for name in adapters)
        print(f"minillm deploy: replica {self.replica_id} ({held}): {phases}; ready (warmed)")
        self.identity = _identity_hex(self.worker)
        access = Access(keys=KeyRing(list(config.api_keys), list(config.observer_keys)))
        self.asgi = Tagged(create_app(self.worker, access=access), self.replica_id, config.weight_dtype, adapters)

    def __serve_build_asgi_app__(self):
        return self.asgi

    def load_report(self) -> dict:
        """This replica's load: its id, weight dtype, adapters' names, each load phase's seconds and the
        seconds to ready."""
        return dict(self.load)

    def record_routing_stats(self) -> dict:
        """What the prefix router reads (router.py): this pool's cached block hashes (hex), the hashes'
        identity (hex), its block size and count, and its requests running and waiting."""
        worker = self.worker
        pool = worker.pool
        return {
            "blocks": [h.hex() for h in list(pool.cached)],
            "identity": self.identity,
            "block_size": pool.block_size,
            "num_blocks": pool.num_blocks,
            "load": worker.running + worker.waiting,
        }

    def check_health(self) -> None:
        """Ray's health check: raises while the worker thread is gone."""
        if not self.worker.alive:
            raise RuntimeError(f"replica {self.replica_id}: the model's worker thread stopped")

    async def relay(self, scope: dict, body: bytes):
        """Run one HTTP request through this replica's app in-process; yields its ASGI send messages
        (dicts: ``http.response.start``, then ``http.response.body`` chunks)."""
        sent = asyncio.Queue()
        given = False
        finished = asyncio.Event()

        async def receive():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await finished.wait()  # the client of a relay never leaves early
            return {"type": "http.disconnect"}

        task = asyncio.create_task(self.asgi(dict(scope, app=self.asgi), receive, sent.put))
        try:
            while True:
                getter = asyncio.ensure_future(sent.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    while not sent.empty():
                        yield sent.get_nowait()
                    task.result()
                    return
                yield getter.result()
        finally:
            finished.set()

    def __del__(self):
        """Drain (``minillm serve``'s SIGTERM drain): new requests get 503, the ones in flight end."""
        guard = self.worker.guard
        guard.draining = True
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        while guard.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        finished = sum(label == "finished" for _, label, _ in guard.drained)
        print(
            f"minillm deploy: replica {self.replica_id} stopped: Ray let the requests it served end first; "
            f"{len(guard.drained)} were still in flight here and drained ({finished} finished)"
        )


def _identity_hex(worker: Worker) -> str:
    """The prefix cache's identity of ``worker``'s blocks (``runtime.kv_identity``), hex."""
    from minillm.runtime.kv_identity import kv_identity

    return kv_identity(worker.model, worker.pool.keys.dtype.name).hex()
