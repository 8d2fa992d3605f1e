"""How fast this machine streams *this model's* matrices: one decode step's products, timed.

``calibrate.py`` measures the machine on a 96 MiB matrix, three times the last-level cache of
typical CPUs. A CPU with a larger last-level cache (hundreds of MiB) keeps that matrix, and
the rate it gives is the cache's, not the memory's: a decode step over a model several times
that matrix's size then takes about twice what the machine's rate promises, with nothing wrong.
So the decode expectation also reads the model's own float32 matrices, as a decode step does:
one token's ``[1, in]`` row through every projection and the LM head, nothing between them
(``benchmarks/speed.py`` times the same pass as "products alone"). Measured once per loaded
model and BLAS thread count (a few passes: a fraction of a second) and kept on the model: during
a traced warm-up (``describe_summary.prepare_expectations``, which ``minillm run`` and ``minillm
serve`` reach before the model is called ready), else at the first diagnosed request.
"""

from __future__ import annotations

import time

import numpy as np

from minillm.kernels.products import blas_threads
from minillm.observe.calibrate import record_measurement

REPEATS = 3  # timed passes; the best counts (the closest to what the hardware gives)


def products_s_per_byte(model) -> float | None:
    """Seconds per weight byte of one decode step's matrix products over ``model``'s own matrices
    (every projection's parts and the LM head, ``x`` float32 ``[1, in]``; the best of
    :data:`REPEATS` passes after one warm pass). None when a matrix is held in a compact format:
    its product unpacks it first, and the expectation stays the machine's streaming rate, so a
    slow unpacking is still a finding (``diagnosis.unpacking``)."""
    w = model.transformer.weights
    matrices = [p for layer in w.layers for m in layer.projections() for p in m.parts()] + w.lm_head.parts()
    if any(m.dense is None for m in matrices):
        return None
    rates = model.__dict__.setdefault("products_s_per_byte", {})  # BLAS threads -> seconds per byte
    threads = blas_threads()
    if threads not in rates:
        t_start = time.perf_counter()
        inputs = [np.ones((1, m.shape[1]), dtype=np.float32) for m in matrices]  # [1, in] each
        best = float("inf")
        for i in range(REPEATS + 1):
            t0 = time.perf_counter()
            for x, m in zip(inputs, matrices, strict=True):
                m.linear(x)  # [1, in] @ [in, out]
            if i:  # the first pass warms the pages and the BLAS
                best = min(best, time.perf_counter() - t0)
        rates[threads] = best / sum(m.nbytes for m in matrices)
        record_measurement("products_rate", time.perf_counter() - t_start)
    return rates[threads]
