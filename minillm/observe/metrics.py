"""Measurements around a request: memory tables, the machine's BLAS, and other processes' CPU.

The request's own times (TTFT, TPOT, tokens/s) are measured by the runtime
(``runtime.request.RequestMetrics``); this module adds what a listener measures beside them:
- memory: weight bytes and KV-cache bytes at each dtype, from the model's shapes;
- the BLAS that runs the matrix products, and its threads (threadpoolctl);
- others' CPU share: the share of all cores' time that *other* processes used during the request
  (0 to 1). A number far from 0 means the request shared the cores, and its times are not the
  model's alone.
"""

from __future__ import annotations

import math
import os
import resource
import time

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from minillm.model.config import KV_DTYPES, ModelConfig

#: bytes per parameter (or cache element) for the memory table of the next lesson.
#: weight formats for the "what would it take" table, with gguf's own block sizes (GGML_QUANT_SIZES):
#: a block of B weights takes S bytes, so bits per weight = 8 S / B (Q4_1: 20 bytes per 32 = 5.0)
WEIGHT_FORMATS = {
    "float32": GGMLQuantizationType.F32,
    "bfloat16": GGMLQuantizationType.BF16,
    "Q8_0": GGMLQuantizationType.Q8_0,  # int8 values, one float16 scale per 32
    "Q4_1": GGMLQuantizationType.Q4_1,  # 4-bit values, a float16 scale and minimum per 32
    "Q4_K": GGMLQuantizationType.Q4_K,  # 4-bit values in super-blocks of 256, 6-bit sub-block scales
}


def bits_per_weight(kind: GGMLQuantizationType) -> float:
    """Bits a weight takes in a block format, scales included: ``8 * block bytes / block size``."""
    block_size, block_bytes = GGML_QUANT_SIZES[kind]
    return 8 * block_bytes / block_size


def cpu_snapshot() -> tuple[float, float, float]:
    """``(wall seconds, busy CPU-seconds of the whole machine, CPU-seconds of this process)`` now.

    The machine's busy time is every core's time not idle, from Linux's ``/proc/stat`` (NaN where
    there is none); this process's is user + system time of all its threads (``getrusage``).
    """
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]  # the "cpu" line: all cores summed
        busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    own = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), busy, own.ru_utime + own.ru_stime


def others_cpu_share(
    before: tuple[float, float, float], after: tuple[float, float, float], cores: int | None = None
) -> float:
    """The share (0..1) of all cores' time that other processes used between two :func:`cpu_snapshot` s.

    ``(machine busy seconds - this process's CPU seconds) / (wall seconds * cores)``; NaN when the
    machine's busy time is unknown or no time passed.
    """
    (wall0, busy0, own0), (wall1, busy1, own1) = before, after
    cores = cores or os.cpu_count() or 1
    if math.isnan(busy0) or math.isnan(busy1) or wall1 <= wall0:
        return float("nan")
    others = max(0.0, (busy1 - busy0) - (own1 - own0))
    return min(1.0, others / ((wall1 - wall0) * cores))


def weight_memory_table(num_parameters: int) -> dict[str, int]:
    """Bytes ``num_parameters`` weights would take in each of :data:`WEIGHT_FORMATS`, at the format's
    real bits per weight (:func:`bits_per_weight`; the scales stored with the blocks included)."""
    return {name: round(num_parameters * bits_per_weight(kind) / 8) for name, kind in WEIGHT_FORMATS.items()}


def held_weight_table(formats: dict[str, tuple[int, int]]) -> dict[str, dict[str, float]]:
    """The weights as actually held: ``{format: {"parameters", "bytes", "bits_per_weight"}}`` from
    ``Weights.formats()`` (real block sizes: Q4_1 is 20 bytes per 32 weights, 5.0 bits), plus ``"total"``."""
    rows = {f: {"parameters": n, "bytes": b, "bits_per_weight": 8 * b / n} for f, (n, b) in formats.items() if n}
    n, b = sum(r["parameters"] for r in rows.values()), sum(r["bytes"] for r in rows.values())
    rows["total"] = {"parameters": n, "bytes": b, "bits_per_weight": 8 * b / n if n else 0.0}
    return rows


def kv_memory_table(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """KV-cache bytes ``(per token, at full context)`` in each of ``config.KV_DTYPES``, from the layout
    ``KVCache`` uses (``config.kv_bytes_per_token``); full context multiplies by ``max_position_embeddings``."""
    table = {}
    for name in KV_DTYPES:
        per_token = config.kv_bytes_per_token(name)
        table[name] = (per_token, per_token * config.max_position_embeddings)
    return table


def format_bytes(n: float) -> str:
    """``123456789`` -> ``'117.7 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def blas_summary() -> list[str]:
    """Which BLAS runs the matrix multiplies, and with how many threads (threadpoolctl)."""
    from threadpoolctl import threadpool_info

    return [
        f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture') or '?'}), "
        f"{i.get('num_threads')} thread{'' if i.get('num_threads') == 1 else 's'}"
        for i in threadpool_info()
        if i.get("user_api") == "blas"
    ]
