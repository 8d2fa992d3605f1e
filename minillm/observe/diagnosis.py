"""Diagnosis: the seed lesson's table, made executable, against what this machine should manage.

    symptom                              phase                 look at
    slow to become ready                 loading               download / conversion / reading weights
    first request slow                   warm-up               run a warm-up request before "ready"
    long input delays the first token    prefill               prompt length (prefill is one big GEMM)
    slow after the first token           decode                bytes read per token (weights + KV)
    odd text fragments                   tokenizer / template  chat template, special tokens, detokenizer
    slow on a shared machine             threads               BLAS threads competing with other processes

A phase is a finding only when it was *slow*: measured more than :data:`THRESHOLD` times what it
should take on this machine (``calibrate.py`` computes that from the model's bytes and FLOPs and
the machine's measured rates). For the first token of a long prompt, the yardstick is a one-token
prompt's: a wait more than 2x that is the prompt's length, even when prefill ran as fast as the
machine allows. The largest phase of a healthy request is not a symptom: a healthy
request gets no finding, and the table of measured vs expected says why. Two findings need no
expectation: "first request slow" compares the first request's per-token rates with the median of
the later ones on the same loaded model (``Model.history``), and "slow on a shared machine" reads
other processes' share of the cores, whichever phase dominated.

Times are seconds as measured (``RequestMetrics``, ``Model.load_s``, the warm-up's duration).
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field

from minillm.runtime.request import RequestMetrics

#: A phase is slow when measured > THRESHOLD x expected: the expectations are estimates from a few
#: measured rates, so a margin keeps a healthy request from ever being called slow.
THRESHOLD = 2.0

#: ... and, for the first token, more than this many seconds over it: the estimate counts bytes and
#: FLOPs, and a short prompt's first token is mostly the fixed costs it leaves out (tokenizing, the
#: Python between the layers), so tens of milliseconds over it are no symptom a user could see.
MIN_EXCESS_S = {"prefill": 0.04}

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
        "run with --threads {fix} (minillm.load(..., threads={fix}))",
    ),
}

#: A prompt shorter than this is never "long input", however long its first token took.
LONG_PROMPT_TOKENS = 128

#: Other processes keeping at least this many cores busy count as a neighbour (half a core).
BUSY_CORES = 0.5


@dataclass
class PhaseCheck:
    """One row of the table: a phase's measured and expected seconds."""

    phase: str  # "loading", "prefill" (TTFT), "decode" (TPOT at this context)
    measured_s: float
    expected_s: float | None  # None: nothing to expect it from

    @property
    def ratio(self) -> float:
        """measured / expected (NaN without an expectation)."""
        return self.measured_s / self.expected_s if self.expected_s else float("nan")

    @property
    def slow(self) -> bool:
        excess = self.measured_s - (self.expected_s or 0.0)
        # NaN compares False: no expectation, no finding
        return self.ratio > THRESHOLD and excess > MIN_EXCESS_S.get(self.phase, 0.0)


@dataclass
class Diagnosis:
    """What a request's measurements say: the table of phases, and every finding (first = main).

    ``findings`` is empty for a healthy request (:attr:`healthy`).
    """

    phase_seconds: dict[str, float]  # loading, warm-up, prefill (= TTFT), decode: seconds
    dominant: str  # the largest phase: shown, never a finding by itself
    checks: list[PhaseCheck] = field(default_factory=list)
    findings: list[tuple[str, str, str]] = field(default_factory=list)  # (phase, symptom, points to)
    threshold: float = THRESHOLD

    @property
    def main(self) -> tuple[str, str, str]:
        return self.findings[0]

    @property
    def healthy(self) -> bool:
        return not self.findings


def contention(others_cpu_share: float, blas_threads: int | None, cores: int | None = None) -> int | None:
    """The thread count to advise when the BLAS's threads cannot each have a core, else None.

    Other processes keep ``others_cpu_share * cores`` cores busy. When that is at least
    :data:`BUSY_CORES` and, added to the BLAS's threads, exceeds the cores, some BLAS thread waits
    for a core and every multiply waits for it. Advise the threads that fit beside the neighbours
    (at least 1). The rule scales with the core count: on 2 cores, a neighbour using a quarter of
    the machine's time (half a core) is enough against 2 threads; on 64 cores with 8 threads it
    takes 56.5 busy cores.
    """
    cores = cores or os.cpu_count() or 1
    threads = blas_threads or 1
    if threads <= 1 or not others_cpu_share >= 0:  # NaN: unknown
        return None
    busy = others_cpu_share * cores
    if busy < BUSY_CORES or busy + threads <= cores:
        return None
    return max(1, min(threads - 1, cores - math.ceil(busy)))


def first_request_slower(history: list[dict]) -> tuple[str, float] | None:
    """Whether the first request on a model ran slower than the later ones: compares its TPOT and
    its prefill seconds per token with the median of the later requests' (prefill only against
    prompts of similar length, within 2x: per-token prefill cost falls with length).

    Returns:
        ``(what, ratio)`` for the larger ratio above :data:`THRESHOLD`, else None (also with
        fewer than two requests: nothing to compare yet).
    """
    if len(history) < 2:
        return None
    first, later = history[0], history[1:]
    found = []
    tpots = [h["tpot_s"] for h in later if h["tpot_s"] > 0]  # NaN (no decode step) compares False
    if tpots and first["tpot_s"] > 0:
        found.append(("TPOT", first["tpot_s"] / statistics.median(tpots)))
    n = first["prompt_tokens"]
    similar = [h["prefill_s_per_token"] for h in later if n / 2 <= h["prompt_tokens"] <= 2 * n]
    similar = [x for x in similar if x > 0]  # NaN (no first token) and 0 compare with nothing
    if similar and first["prefill_s_per_token"] > 0:
        found.append(("prefill per token", first["prefill_s_per_token"] / statistics.median(similar)))
    worst = max(found, key=lambda f: f[1], default=None)
    return worst if worst is not None and worst[1] > THRESHOLD else None


def unpacking(phase: str, held_formats: tuple[str, ...]) -> str:
    """What a slow ``phase`` points to when the weights are held packed (``held_formats``)."""
    return (
        f"{phase}: the weights are held as {', '.join(held_formats)} and each product unpacks its matrix to "
        "float32 first (NumPy has no low-bit product; lesson 12 measures it); weight_dtype='float32' "
        "is fastest here, a fused runtime (llama.cpp) reads the packed bytes directly"
    )


def diagnose(
    metrics: RequestMetrics,
    *,
    expected: dict[str, float] | None = None,
    load_s: float | None = None,
    warmup_s: float | None = None,
    first_request: bool = False,
    text: str = "",
    special_tokens: tuple[str, ...] = (),
    load_source: str | None = None,
    blas_threads: int | None = None,
    others_cpu_share: float = float("nan"),
    load_others_cpu_share: float = float("nan"),
    history: list[dict] | None = None,
    cores: int | None = None,
    weight_seconds: dict[str, float] | None = None,
    held_formats: tuple[str, ...] = (),
) -> Diagnosis:
    """Say whether any phase was slow, and what it points to.

    Args:
        metrics: the request's measurements (TTFT and decode step times, seconds).
        expected: seconds each phase should take on this machine (``calibrate.py``):
            ``"loading"`` (from local files), ``"prefill"`` (TTFT for this prompt), ``"decode"``
            (TPOT at this request's mean context). A phase without one is shown, never judged.
            ``"prefill_one_token"``: the TTFT a one-token prompt should take; a prompt of at least
            :data:`LONG_PROMPT_TOKENS` whose TTFT exceeds 2x that is "long input delays the first
            token" (the wait is the prompt's length, even when prefill ran as fast as it should).
        load_s: seconds the model took to load (only a first request waited for it).
        warmup_s: seconds of the warm-up request; None when warm-up was skipped.
        first_request: True for the first request since load.
        text: the output text, checked for odd fragments (U+FFFD, leaked special tokens).
        special_tokens: the tokenizer's special-token strings (e.g. ``<|im_end|>``).
        load_source: where the model came from (``"cache"`` and ``"local"``: no download).
        blas_threads: the BLAS's thread count; with ``others_cpu_share`` it tells whether the
            forward passes competed with other processes for the cores.
        others_cpu_share: the share (0..1) of all cores' time other processes used during the
            request; NaN when unknown.
        load_others_cpu_share: the same while the model loaded (a first request's slow load may be
            the neighbours' doing too); NaN when unknown.
        history: the model's per-token rates of every request so far, this one last
            (``Model.history``): for "first request slow; later ones improve".
        cores: the machine's cores (default ``os.cpu_count()``).
        weight_seconds: how the weights' load split (``Weights.seconds``: ``read``, ``convert``):
            a slow load says which part was slow.
        held_formats: the formats other than float32 the weight matrices are held in (``"int8"``,
            ``"Q4_1"``, ...; ``Weights.formats``). Each product first unpacks such a matrix to float32
            (``model/held.py``), so a slow decode then points there, not to "a smaller dtype".

    Returns:
        :class:`Diagnosis`; no findings when the request was healthy.
    """
    expected = expected or {}
    startup = 1.0 if first_request else 0.0
    phases = {
        "loading": startup * (load_s or 0.0),
        "warm-up": startup * (warmup_s or 0.0),
        "prefill": metrics.ttft_s,
        "decode": float(sum(metrics.decode_step_s)),
    }
    checks = []
    if first_request and load_s is not None:
        checks.append(PhaseCheck("loading", load_s, expected.get("loading")))
    checks.append(PhaseCheck("prefill", metrics.ttft_s, expected.get("prefill")))
    if metrics.decode_step_s:
        checks.append(PhaseCheck("decode", metrics.tpot_s, expected.get("decode")))
    slow = {c.phase: c for c in checks if c.slow}
    fix = contention(others_cpu_share, blas_threads, cores)
    findings = [
        _odd_text(text, special_tokens),
        _threads(fix, others_cpu_share, blas_threads, cores),
        _loading(slow, load_s, load_source, weight_seconds),
        _prefill(metrics, expected.get("prefill_one_token"), checks, slow, first_request, warmup_s, held_formats),
        _decode(slow, held_formats),
        _shared_machine(fix, slow, others_cpu_share, load_others_cpu_share, cores),
        _earlier_requests(history),
    ]
    found = [f for f in findings if f is not None]
    return Diagnosis(phase_seconds=phases, dominant=max(phases, key=phases.get), checks=checks, findings=found)


Finding = tuple[str, str, str]  # (what, symptom, where it points)


def _because(c: PhaseCheck) -> str:
    return f" ({c.measured_s:.3g} s, {c.ratio:.1f}x the {c.expected_s:.3g} s expected; threshold {THRESHOLD:g}x)"


def _odd_text(text: str, special_tokens: tuple[str, ...]) -> Finding | None:
    """U+FFFD or a special token's text in the output: the tokenizer."""
    leaked = [s for s in special_tokens if s and s in text]
    if "\ufffd" not in text and not leaked:
        return None
    what = "U+FFFD in the output" if "\ufffd" in text else f"special tokens in the text: {leaked}"
    symptom, points_to = TABLE["tokenizer"]
    return ("tokenizer", f"{symptom} ({what})", points_to)


def _threads(fix, others_cpu_share: float, blas_threads: int | None, cores: int | None) -> Finding | None:
    """Whatever phase dominated: a stalled BLAS thread slows every phase."""
    if fix is None:
        return None
    symptom, points_to = TABLE["threads"]
    return (
        "threads",
        f"{symptom} (other processes used {others_cpu_share:.0%} of the cores)",
        points_to.format(threads=blas_threads, cores=cores or os.cpu_count() or "?", fix=fix),
    )


def _loading(slow: dict, load_s: float | None, load_source: str | None, weight_seconds) -> Finding | None:
    """A slow load: a download or conversion, or (cached) reading and laying out the weights."""
    if "loading" not in slow:
        return None
    key = "loading (cached)" if load_source in ("cache", "local") else "loading"
    symptom, points_to = TABLE[key]
    parts = {k: v for k, v in (weight_seconds or {}).items() if k in ("read", "map", "convert")}
    if parts:
        symptom += "; weights " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())
        mostly_weights = sum(parts.values()) >= 0.5 * (load_s or 0.0)  # else the time went elsewhere
        if mostly_weights and parts.get("convert", 0.0) > 2 * max(parts.get("read", 0.0), 1e-9):
            points_to = (
                "loading: most of it laying the weights out in fresh memory, where the kernel finds and "
                "zeroes new pages; slow when memory is busy or fragmented (load(..., mmap=True) skips the copy)"
            )
    return ("loading", symptom + _because(slow["loading"]), points_to)


def _prefill(metrics, short_s, checks, slow, first_request, warmup_s, held_formats) -> Finding | None:
    """A slow first token: one-time costs (no warm-up), a long prompt (``short_s``: a one-token
    prompt's expected TTFT), or slower than this machine manages for the length."""
    long_input = (
        metrics.prompt_tokens >= LONG_PROMPT_TOKENS and short_s and metrics.ttft_s > THRESHOLD * short_s
    )  # the first token waited for the prompt: more than 2x what a one-token prompt should take
    if "prefill" in slow and first_request and warmup_s is None:  # one-time costs land on the first pass
        symptom, points_to = TABLE["warm-up"]
        return ("warm-up", f"{symptom}: no warm-up ran" + _because(slow["prefill"]), points_to)
    if long_input:
        symptom, points_to = TABLE["prefill"]
        c = next(c for c in checks if c.phase == "prefill")
        for_length = f"; {c.ratio:.1f}x what this length should take here" if c.expected_s else ""
        return (
            "prefill",
            f"{symptom}: {metrics.prompt_tokens:,} tokens ({metrics.ttft_s:.3g} s, "
            f"{metrics.ttft_s / short_s:.0f}x a one-token prompt's {short_s:.3g} s{for_length}; "
            f"threshold {THRESHOLD:g}x)",
            points_to,
        )
    if "prefill" in slow:  # neither cold nor long: the prompt's length is not why
        return (
            "prefill",
            f"slow first token for this prompt: {metrics.prompt_tokens:,} tokens" + _because(slow["prefill"]),
            unpacking("prefill", held_formats)
            if held_formats
            else "prefill: slower than this machine manages for this length; a busy machine (others' CPU above), "
            "BLAS threads, or one-time costs",
        )
    return None


def _decode(slow: dict, held_formats: tuple[str, ...]) -> Finding | None:
    """A slow TPOT: the memory-bound decode, or (held formats) the unpacking before every product."""
    if "decode" not in slow:
        return None
    symptom, points_to = TABLE["decode"]
    if held_formats:  # fewer bytes were read, but every product unpacked them first
        points_to = unpacking("decode", held_formats)
    return ("decode", f"{symptom}: TPOT" + _because(slow["decode"]), points_to)


def _shared_machine(fix, slow: dict, others_cpu_share, load_others_cpu_share, cores: int | None) -> Finding | None:
    """The slow phases shared the cores: they may be the neighbours' doing, not the model's."""
    n = cores or os.cpu_count() or 1
    shares = [others_cpu_share] + ([load_others_cpu_share] if "loading" in slow else [])
    share = max((x for x in shares if x == x), default=float("nan"))  # the busiest of the slow phases' windows
    if fix is not None or not (share * n >= BUSY_CORES and slow):
        return None
    return (
        "shared machine",
        f"measured on a busy machine (other processes used {share:.0%} of the cores)",
        "the slow phases shared the cores with other processes, so they are not the model's alone; "
        "measure again when the machine is quieter",
    )


def _earlier_requests(history: list[dict] | None) -> Finding | None:
    """The first request was slower than the later ones: one-time costs a warm-up would pay."""
    earlier = first_request_slower(history or [])
    if earlier is None:
        return None
    what, ratio = earlier
    symptom, points_to = TABLE["warm-up"]
    return (
        "warm-up",
        f"{symptom}; later ones improve (its {what} was {ratio:.1f}x the later requests' median)",
        points_to,
    )
