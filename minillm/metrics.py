"""Metrics: TTFT, TPOT, tokens/s and memory, computed from measured times (seconds) and shapes.

Definitions (as the serving literature uses them):
- TTFT, time to first token: request start (before tokenization) -> first new token sampled.
- TPOT, time per output token: the wall time of each decode step (one forward over one position
  plus sampling); reported as mean, p50 and p90.
- prefill tokens/s = prompt tokens / prefill seconds; decode tokens/s = 1 / mean TPOT.
- others' CPU share: the share of all cores' time that *other* processes used during the request
  (0 to 1). A number far from 0 means the request shared the cores, and its times are not the
  model's alone.
"""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .config import ModelConfig

#: bytes per parameter (or cache element) for the memory table of the next lesson.
DTYPE_BYTES = {"float32": 4.0, "bfloat16/float16": 2.0, "int8": 1.0, "int4": 0.5}


@dataclass
class RequestMetrics:
    """Measured times (seconds) and sizes (tokens, bytes) of one request."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    tokenize_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_step_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    kv_bytes_per_token: int = 0
    kv_bytes_used: int = 0
    kv_bytes_reserved: int = 0
    others_cpu_share: float = float("nan")  # 0..1 of all cores' time used by other processes; NaN: unknown

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def tpot_s(self) -> float:
        """Mean decode step time in seconds (NaN when there was no decode step)."""
        return float(np.mean(self.decode_step_s)) if self.decode_step_s else float("nan")

    def tpot_percentile(self, q: float) -> float:
        return float(np.percentile(self.decode_step_s, q)) if self.decode_step_s else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.tpot_s if self.decode_step_s else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            tpot_s=self.tpot_s,
            tpot_p50_s=self.tpot_percentile(50),
            tpot_p90_s=self.tpot_percentile(90),
            decode_tokens_per_s=self.decode_tokens_per_s,
        )
        return d


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


def others_cpu_share(before: tuple[float, float, float], after: tuple[float, float, float],
                     cores: int | None = None) -> float:
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
    """Bytes the weights take at each dtype: ``parameters * bytes per parameter``."""
    return {name: int(num_parameters * b) for name, b in DTYPE_BYTES.items()}


def kv_memory_table(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """KV-cache bytes ``(per token, at full context)`` at each dtype.

    per token = ``2 * layers * kv_heads * head_dim * bytes``; full context multiplies by
    ``max_position_embeddings``.
    """
    table = {}
    for name, b in DTYPE_BYTES.items():
        per_token = int(2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * b)
        table[name] = (per_token, per_token * config.max_position_embeddings)
    return table


def format_bytes(n: float) -> str:
    """``123456789`` -> ``'117.7 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
