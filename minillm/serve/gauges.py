"""The gauges /metrics reads from one model's worker at scrape time (counts and bytes).

A mixin of :class:`~minillm.serve.worker.Worker` (and so of each several-model slot): it reads the
worker's ``scheduler``, ``pool``, ``queue``, ``active`` and ``thread``, each None until the worker
builds it, and answers 0 (or False) meanwhile.
"""

from __future__ import annotations


class Gauges:
    """Read-only counts of a worker's requests and KV-pool bytes (``ServedModels``' gauges)."""

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

    @property
    def blocks_used(self) -> int:
        """KV-pool blocks held by requests."""
        return self.pool.num_used_blocks if self.pool is not None else 0

    @property
    def blocks_total(self) -> int:
        """KV-pool blocks in all (0 before the pool is built)."""
        return self.pool.num_blocks if self.pool is not None else 0

    @property
    def tracked(self) -> int:
        """Requests admitted and not yet answered."""
        return len(self.active)

    @property
    def alive(self) -> bool:
        """True while the worker thread runs."""
        return self.thread is not None and self.thread.is_alive()
