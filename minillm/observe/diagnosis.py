"""Diagnosis: the seed lesson's table, made executable.

From a request's measured phase times, say which phase dominated and what that points to:

    symptom                              phase                 look at
    slow to become ready                 loading               download / conversion / reading weights
    first request slow                   warm-up               run a warm-up request before "ready"
    long input delays the first token    prefill               prompt length (prefill is one big GEMM)
    slow after the first token           decode                bytes read per token (weights + KV)
    odd text fragments                   tokenizer / template  chat template, special tokens, detokenizer
    slow on a shared machine             threads               BLAS threads competing with other processes

Times are seconds as measured (``RequestMetrics``, ``Model.load_s``, the warm-up's duration).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from minillm.runtime.request import RequestMetrics

#: (symptom, what it points to) for each phase, in the words of the table above.
TABLE = {
    "loading": (
        "slow to become ready",
        "loading: download, GGUF conversion or reading the weights; a second run loads from the cache",
    ),
    "loading (cached)": (
        "slow to become ready",
        "loading: reading the weights from disk (the model was "
        "already local: no download or conversion); a slow disk, or a busy machine",
    ),
    "warm-up": (
        "first request slow",
        "warm-up: the first request after load pays one-time costs "
        "(weights paged in, BLAS threads started); run a warm-up request before 'ready'",
    ),
    "prefill": (
        "long input delays the first token",
        "prefill: time grows with prompt length; shorten the prompt or reuse a cached prefix",
    ),
    "decode": (
        "slow after the first token",
        "decode: each step reads every weight once "
        "(memory-bandwidth bound); fewer bytes per token (a smaller dtype) or fewer tokens",
    ),
    "tokenizer": (
        "odd text fragments",
        "tokenizer / chat template / detokenization: check the "
        "template output, special tokens and the streaming detokenizer",
    ),
    "threads": (
        "slow on a shared machine",
        "threads: {threads} BLAS threads compete with other processes "
        "for {cores} cores, and a BLAS thread that loses its core stalls every matrix multiply; "
        "run with --threads 1 (minillm.load(..., threads=1))",
    ),
}

#: Other processes using at least this share of all cores' time during a request make its
#: forward passes compete for the cores (on 2 cores: half a core).
BUSY_SHARE = 0.25

#: Prompts at least this long can make prefill dominate on their own; a short prompt that still
#: dominates on the first request points to missing warm-up instead.
LONG_PROMPT_TOKENS = 128


@dataclass
class Diagnosis:
    """Which phase dominated a request, and every finding (first = the main one)."""

    phase_seconds: dict[str, float]  # loading, warm-up, prefill (= TTFT), decode: seconds
    dominant: str  # key of TABLE
    findings: list[tuple[str, str, str]] = field(default_factory=list)  # (phase, symptom, points to)

    @property
    def main(self) -> tuple[str, str, str]:
        return self.findings[0]


def diagnose(
    metrics: RequestMetrics,
    *,
    load_s: float | None = None,
    warmup_s: float | None = None,
    first_request: bool = False,
    text: str = "",
    special_tokens: tuple[str, ...] = (),
    load_source: str | None = None,
    blas_threads: int | None = None,
    others_cpu_share: float = float("nan"),
) -> Diagnosis:
    """Name the phase that dominated and what it points to.

    Args:
        metrics: the request's measurements (TTFT and decode step times, seconds).
        load_s: seconds the model took to load.
        warmup_s: seconds of the warm-up request; None when warm-up was skipped.
        first_request: True for the first request since load. Only then do loading and warm-up
            count: a later request did not wait for them.
        text: the output text, checked for odd fragments (U+FFFD, leaked special tokens).
        special_tokens: the tokenizer's special-token strings (e.g. ``<|im_end|>``).
        load_source: where the model came from (``ResolvedModel.source``: "cache" and "local" mean
            no download or conversion happened).
        blas_threads: the BLAS's thread count; with ``others_cpu_share`` it tells whether the
            forward passes competed with other processes for the cores.
        others_cpu_share: the share (0..1) of all cores' time other processes used during the
            request (``metrics.others_cpu_share``); NaN when unknown.

    Returns:
        :class:`Diagnosis`; ``findings[0]`` is the main one.
    """
    decode_s = float(sum(metrics.decode_step_s))
    startup = 1.0 if first_request else 0.0
    phases = {
        "loading": startup * (load_s or 0.0),
        "warm-up": startup * (warmup_s or 0.0),
        "prefill": metrics.ttft_s,
        "decode": decode_s,
    }
    dominant = max(phases, key=phases.get)
    # A short prompt cannot make prefill slow by itself: on a cold first request it is warm-up.
    if dominant == "prefill" and warmup_s is None and first_request and metrics.prompt_tokens < LONG_PROMPT_TOKENS:
        dominant = "warm-up"
    if dominant == "warm-up" and warmup_s is not None:
        # The warm-up ran and was the slowest phase: its one-time costs were paid before "ready".
        findings = [
            (
                "warm-up",
                "slow to become ready (warm-up)",
                "warm-up: one-time costs (weights paged "
                "in, BLAS threads started) were paid before 'ready', so requests do not pay them",
            )
        ]
    elif dominant == "loading" and load_source in ("cache", "local"):
        findings = [(dominant, *TABLE["loading (cached)"])]
    else:
        findings = [(dominant, *TABLE[dominant])]
    share = others_cpu_share
    if dominant in ("prefill", "decode") and (blas_threads or 1) > 1 and share >= BUSY_SHARE:
        # A BLAS thread that loses its core stalls every multiply (lesson 8 measures it).
        symptom, points_to = TABLE["threads"]
        if dominant == "prefill" and metrics.prompt_tokens < LONG_PROMPT_TOKENS:
            findings = [f for f in findings if f[0] != "prefill"]  # a short prompt is not why
        findings.insert(
            0,
            (
                "threads",
                f"{symptom} (other processes used {share:.0%} of the cores)",
                points_to.format(threads=blas_threads, cores=os.cpu_count() or "?"),
            ),
        )
    if dominant != "warm-up" and warmup_s is None and first_request:
        findings.append(("warm-up", *TABLE["warm-up"]))
    leaked = [s for s in special_tokens if s and s in text]
    if "\ufffd" in text or leaked:
        what = "U+FFFD in the output" if "\ufffd" in text else f"special tokens in the text: {leaked}"
        symptom, points_to = TABLE["tokenizer"]
        findings.insert(0, ("tokenizer", f"{symptom} ({what})", points_to))
    return Diagnosis(phases, dominant, findings)
