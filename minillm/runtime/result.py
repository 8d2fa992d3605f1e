"""What a request measures and returns: :class:`RequestMetrics` and :class:`GenerationResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minillm.runtime.stopping import StopReason


@dataclass
class RequestMetrics:
    """Measured times (seconds) and sizes (tokens, bytes) of one request.

    TTFT: request start (before tokenization) -> first new token sampled. TPOT: the wall time of
    each decode step (one forward over one position plus sampling). Prefill tokens/s = prompt
    tokens / prefill seconds; decode tokens/s = 1 / mean TPOT.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    tokenize_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_step_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    kv_dtype: str = "float32"  # how the KV cache held its entries (KVCache dtype)
    kv_bytes_per_token: int = 0
    kv_bytes_used: int = 0
    kv_bytes_reserved: int = 0
    cached_prompt_tokens: int = 0  # prompt positions reused from a paged pool's prefix cache (batching)
    preemptions: int = 0  # times the batch scheduler took this request's blocks back to recompute later
    target_passes: int = 0  # forward passes of the model over this request (prefill chunks included)
    drafted_tokens: int = 0  # speculative decoding: tokens a draft proposed, and how many were kept
    accepted_tokens: int = 0
    rejections: int = 0  # speculative passes that rejected a draft (at most one each: the first mismatch)
    verify_steps: int = 0  # speculative passes that checked at least one drafted token
    speculative_k: int = 0  # tokens drafted per pass at most (Speculative.num_tokens); 0: no speculation
    prompt_tokens_computed: int = 0  # prompt positions the batch scheduler fed (cache hits not; recomputed again)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def tpot_s(self) -> float:
        """Mean decode step time in seconds (NaN when there was no decode step)."""
        return float(np.mean(self.decode_step_s)) if self.decode_step_s else float("nan")

    def tpot_percentile(self, q: float) -> float:
        """The ``q``-th percentile of the decode step times, seconds (NaN without decode steps)."""
        return float(np.percentile(self.decode_step_s, q)) if self.decode_step_s else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return 1.0 / self.tpot_s if self.decode_step_s else float("nan")

    def rates(self) -> dict:
        """The per-token rates ``Model.history`` keeps: prompt tokens, TTFT seconds per prompt token
        (NaN without a first token), mean TPOT seconds (NaN without decode steps)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            # NaN when no first token came (cancelled or timed out before it): nothing was measured
            "prefill_s_per_token": self.ttft_s / max(self.prompt_tokens, 1) if self.ttft_s > 0 else float("nan"),
            "tpot_s": self.tpot_s,
        }

    def to_dict(self) -> dict:
        """Every field and derived rate, as plain data."""
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}
        d["decode_step_s"] = list(self.decode_step_s)
        d.update(
            acceptance_rate=self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else float("nan"),
            tokens_per_pass=self.new_tokens / self.target_passes if self.target_passes else float("nan"),
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            tpot_s=self.tpot_s,
            tpot_p50_s=self.tpot_percentile(50),
            tpot_p90_s=self.tpot_percentile(90),
            decode_tokens_per_s=self.decode_tokens_per_s,
        )
        return d


@dataclass
class GenerationResult:
    """What ``generate`` returns: the new text and ids, why it stopped, and the measurements."""

    text: str  # what the user sees: no EOS text, no stop string (unless asked), no half characters
    ids: list[int]  # every new token id, the stopping EOS / stop sequence included
    prompt_ids: list[int]
    stop_reason: StopReason
    metrics: RequestMetrics
    stop_condition: object = None  # which condition fired: the stop string, the id sequence, ...
    logprobs: list[dict] | None = None  # with params.top_logprobs: one sampling.model_logprobs per new id
    incomplete: str | None = None  # with a constraint: why the text is not a whole document (else None)
