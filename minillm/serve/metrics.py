"""The server's Prometheus metrics, in a registry of its own (never the process-global one).

Names follow vLLM's where they mean the same thing (``time_to_first_token_seconds`` ...), with the
prefix ``minillm_``. Latencies are seconds; tokens are counts; KV memory is bytes.
"""

from __future__ import annotations

import secrets

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


def _geometric(lo: float, hi: float, ratio: float) -> list[float]:
    """Bucket bounds lo, lo*ratio, ... up to hi (seconds). Fine buckets keep a median read off
    the histogram within a few percent (the bench test compares it with the client's)."""
    bounds, b = [], lo
    while b < hi * ratio:
        bounds.append(round(b, 6))
        b *= ratio
    return bounds


LATENCY_BUCKETS = _geometric(0.001, 120.0, 1.15)  # a millisecond .. 2 min, 15 % apart (~85 buckets)


class ServerMetrics:
    """Histograms, counters and gauges for one server; ``render()`` is the /metrics body."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.instance = secrets.token_hex(4)  # makes request ids unique across server restarts
        r = self.registry

        def latency(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = latency("minillm_time_to_first_token_seconds", "Arrival to first token, queue wait included (s)")
        self.tpot = latency(
            "minillm_time_per_output_token_seconds", "One decode step: time between two output tokens (s)"
        )
        self.e2e = latency("minillm_e2e_request_latency_seconds", "Arrival to last token (s)")
        self.queue_wait = latency("minillm_request_queue_time_seconds", "Arrival to the worker picking it up (s)")
        self.prompt_tokens = Counter(
            "minillm_prompt_tokens",
            "Prompt tokens the model computed (prefix-cache hits not counted, a preempted request's recomputed "
            "prompt counted again, a request cancelled before it ran: none)",
            registry=r,
        )
        self.generation_tokens = Counter("minillm_generation_tokens", "Output tokens the model sampled", registry=r)
        self.finished = Counter(
            "minillm_request_finished",
            "Requests that ended, each once, by final state: its stop reason (eos, cancelled, timed out, ...), "
            "refused (the runtime refused it: 400) or error (500); a full queue's 429 is minillm_request_rejected",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter("minillm_request_rejected", "Requests refused with 429 (queue full)", registry=r)
        self.running = Gauge("minillm_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("minillm_num_requests_waiting", "Requests waiting in the queue", registry=r)
        self.kv_reserved = Gauge(
            "minillm_kv_cache_bytes_reserved", "KV-cache bytes allocated by running requests", registry=r
        )
        self.kv_in_use = Gauge("minillm_kv_cache_bytes_in_use", "KV-cache bytes holding filled positions", registry=r)
        # leak checks: after every request has ended, no block is held and no request tracked
        self.blocks_used = Gauge("minillm_kv_cache_blocks_used", "KV-cache pool blocks held by requests", registry=r)
        self.blocks_total = Gauge("minillm_kv_cache_blocks_total", "KV-cache pool blocks in all", registry=r)
        self.tracked = Gauge("minillm_requests_tracked", "Requests the worker holds state for", registry=r)
        self.worker_alive = Gauge("minillm_worker_alive", "1 while the model's worker thread runs", registry=r)

    def bind(self, served) -> None:
        """Read the gauges at scrape time (no bookkeeping in the request loop) from ``served``, the
        :class:`~minillm.serve.interface.ServedModels` behind the app (``app.create_app`` binds it, once)."""
        self.running.set_function(lambda: served.running)
        self.waiting.set_function(lambda: served.waiting)
        self.kv_reserved.set_function(lambda: served.kv_bytes_reserved)
        self.kv_in_use.set_function(lambda: served.kv_bytes_in_use)
        self.blocks_used.set_function(lambda: served.blocks_used)
        self.blocks_total.set_function(lambda: served.blocks_total)
        self.tracked.set_function(lambda: served.tracked)
        self.worker_alive.set_function(lambda: float(served.alive))

    def observe_latencies(self, ttft: float | None, decode_steps: list[float], e2e: float) -> None:
        """A finished request's TTFT (None: no token), each of its decode steps (TPOT) and e2e, seconds."""
        if ttft is not None:
            self.ttft.observe(ttft)
        for step in decode_steps:
            self.tpot.observe(step)
        self.e2e.observe(e2e)

    def count_tokens(self, request) -> None:
        """Count the prompt tokens the model computed for an ended ``BatchRequest`` (prefix-cache hits
        and a request that never ran: none) and the tokens it sampled."""
        self.prompt_tokens.inc(request.metrics.prompt_tokens_computed)
        self.generation_tokens.inc(len(request.new_ids))

    def render(self) -> bytes:
        """The Prometheus text exposition of this server's registry."""
        return generate_latest(self.registry)
