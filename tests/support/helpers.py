"""Small helpers shared by test modules (imported as ``from helpers import ...``; tests/ is on sys.path)."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def run_bench(url: str, model: str, out: Path, *, concurrency: str, requests: int, prompt_tokens: int,
              max_tokens: int, extra: tuple = (), env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m minillm bench`` against ``url`` the way a user would (a subprocess, 160
    columns, results written as JSON to ``out``; ``extra`` flags after the others, ``env`` variables over
    the test's); return the finished process, output captured as text.
    The caller asserts on its return code: a failed bench is a test's finding, not an exception here."""
    cmd = [sys.executable, "-m", "minillm", "bench", "--url", url, "--model", model, "--concurrency", concurrency,
           "--requests", str(requests), "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(max_tokens),
           "--json", str(out), *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "COLUMNS": "160", **(env or {})})


def release_memory() -> None:
    """Collect dropped objects (cycles included) and hand the freed heap back to the system: glibc
    keeps freed small blocks otherwise, and the RSS budget (tests/support/rss_budget.py) counts them."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory is still free for this process
        pass


class Inbox:
    """Stands in for a job's event loop and channel in worker tests without HTTP: what the worker
    sends lands in ``items`` at once, as ``(kind, value)``."""

    def __init__(self):
        self.items: list[tuple[str, object]] = []

    def call_soon_threadsafe(self, callback, *args) -> None:
        callback(*args)

    def put_nowait(self, item) -> None:
        self.items.append(item)

    def qsize(self) -> int:
        """Items the client has not read yet (the backpressure guard asks): none, it reads at once."""
        return 0

    @property
    def end(self):
        """The last item: ``("done", Outcome)`` or ``("error", exc)`` once the request ended."""
        return self.items[-1] if self.items and self.items[-1][0] in ("done", "error") else None


def stepped_worker(model, **options):
    """A server's Worker serving ``model`` in this thread, no HTTP and no worker thread: submit jobs,
    then call ``worker.serve_once()`` to run one step (``finish`` runs until nothing is left)."""
    from minillm.serve.metrics import ServerMetrics
    from minillm.serve.worker import Worker

    worker = Worker("test", metrics=ServerMetrics(), warmup=False, **{"kv_cache_mib": 16.0, **options})
    worker.attach(model)
    return worker


def stepped_registry(models: dict, **options):
    """A several-model server's registry (``ModelRegistry``) over in-memory ``models`` (served name ->
    model), every slot loaded, no thread: a slot steps by hand as a stepped Worker does
    (``slot.serve_once()``). ``options``: the Worker arguments every slot shares."""
    from minillm.runtime.memory_plan import make_plan
    from minillm.serve.metrics import ServerMetrics
    from minillm.serve.models import ModelRegistry, ModelSlot, ModelSpec

    options = {"kv_cache_mib": 16.0, "warmup": False, **options}
    specs = [ModelSpec(name, name, "float32") for name in models]
    registry = ModelRegistry(specs, metrics=ServerMetrics(), kv_cache_mib=options["kv_cache_mib"],
                             **{k: v for k, v in options.items() if k != "kv_cache_mib"})  # fmt: skip
    for spec, model in zip(specs, models.values(), strict=True):
        plan = make_plan(model.config, model=spec.served, kv_cache_mib=options["kv_cache_mib"])
        slot = ModelSlot(spec, plan, on_submit=registry.wake, metrics=registry.metrics, guard=registry.guard,
                         events=registry.events, **options)  # fmt: skip
        slot.attach(model)
        slot.state = "loaded"  # what the registry's thread sets after ``slot.load``
        registry.slots[spec.served] = slot
    registry.status = "ready"
    return registry


def job(prompt, *, chat=False, max_tokens=8, stop=None, top_logprobs=None, params=None, request_id="r"):
    """A worker Job whose answers land in its ``Inbox`` (``job.channel``)."""
    import minillm
    from minillm.serve.worker import Job

    box = Inbox()
    params = params or minillm.SamplingParams(temperature=0.0)
    return Job(request_id=request_id, prompt=prompt, chat=chat, params=params, max_tokens=max_tokens, stop=stop,
               top_logprobs=top_logprobs, loop=box, channel=box)  # fmt: skip


def finish(worker, max_steps: int = 10_000) -> None:
    """Step ``worker`` until its queue and its scheduler are empty."""
    for _ in range(max_steps):
        if worker.queue.empty() and not worker.scheduler.has_work():
            return
        worker.serve_once()
    raise AssertionError(f"the worker still had work after {max_steps} steps")


def batched_decode_logits(model, batch: int, steps: int = 2) -> np.ndarray:
    """``steps`` batched decode steps of ``batch`` rows (rows at positions 40 + r) over a paged pool:
    logits ``[steps, batch, vocab]``, the rows' greedy ids fed back."""
    from minillm.model.paged_kv_cache import KVCachePool

    cfg, longest = model.config, 40 + batch + steps + 1
    blocks = batch * -(-longest // 16)  # each row's blocks of 16 positions, no more (Gemma 3: 37 KB a position)
    pool = KVCachePool.for_model(cfg, kv_cache_mib=(blocks + 0.5) * 16 * cfg.kv_bytes_per_token() / 2**20)  # floor: blocks
    rng = np.random.default_rng(batch)
    seqs = [pool.sequence(longest) for _ in range(batch)]
    for r, seq in enumerate(seqs):
        pool.grow(seq, 40 + r)
        model.forward(rng.integers(0, cfg.vocab_size, 40 + r), seq, last_only=True)
    out, tokens = [], [7 + r for r in range(batch)]
    for _ in range(steps):
        for seq in seqs:
            pool.grow(seq, 1)
        out.append(model.forward_batch([(np.array([t]), s) for t, s in zip(tokens, seqs, strict=True)]))
        tokens = [int(t) for t in np.argmax(out[-1], axis=-1)]
    return np.stack(out)
