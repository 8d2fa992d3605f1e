"""The ``summary`` event's data: the request's numbers, the memory tables, and the diagnosis of each phase
against what this machine should take (``calibrate.py``'s rates, ``diagnosis.py``'s rules)."""

from __future__ import annotations

import time
from typing import Any

from minillm.kernels.products import blas_threads
from minillm.observe import calibrate
from minillm.observe.diagnosis import diagnose
from minillm.observe.metrics import held_weight_table, kv_memory_table, weight_memory_table
from minillm.observe.products_rate import products_s_per_byte


def prepare_expectations(model) -> dict[str, Any]:
    """Measure now what :func:`expectations` reads, so that no request's step pays for it: this machine's
    rates (``calibrate.machine``: read from the file, else measured, a few seconds; a busy measurement
    is kept for this process) and the model's own products rate (``products_rate.py``). A traced
    warm-up calls it (``describe.warmup``), before ``minillm run`` prints "ready" and before
    ``minillm serve``'s GET /health answers 200.

    Returns:
        ``measured_now`` (the machine was measured here, not read from the file), ``busy`` (that
        measurement is kept for this process only), ``seconds`` spent here, ``products_s_per_byte``
        (None for packed weights); ``{}`` for a stand-in model without weights (nothing to expect).
    """
    try:
        calibrate.model_sizes(model)
    except AttributeError:  # a stand-in model without weights (tests, scripted lessons)
        return {}
    t0 = time.perf_counter()
    machine, measured_now = calibrate.machine_cached()
    rate = products_s_per_byte(model)
    return {
        "measured_now": measured_now,
        "busy": machine.busy,
        "seconds": time.perf_counter() - t0,
        "products_s_per_byte": rate,
    }


def expectations(model, metrics) -> tuple[dict[str, float], dict[str, Any]]:
    """What this request's phases should take on this machine (``calibrate.py``; the machine is
    measured once, a few seconds, then read from the cache), and a note on the calibration."""
    try:
        sizes = calibrate.model_sizes(model)
    except AttributeError:  # a stand-in model without weights (tests, scripted lessons): nothing to expect
        return {}, {}
    machine, measured_now = calibrate.machine_cached()
    steps = len(metrics.decode_step_s)
    context = metrics.prompt_tokens + (steps + 1) / 2  # mean positions a decode step reads
    rate = products_s_per_byte(model)  # the model's own matrices, as decode streams them
    expected = {
        "loading": calibrate.expected_load_s(model, machine),
        "prefill": calibrate.expected_prefill_s(sizes, machine, metrics.prompt_tokens, rate),
        "prefill_one_token": calibrate.expected_prefill_s(sizes, machine, 1, rate),
        "decode": calibrate.expected_tpot_s(sizes, machine, context, rate),
    }
    note = {
        "measured_now": measured_now,
        "seconds": machine.seconds,
        "file": str(calibrate.calibration_file()),
        "others_cpu_share": machine.others_cpu_share,
        "busy": machine.busy,
        "bandwidth_gb_s": machine.bandwidth_b_s / 1e9,
        "gemm_gflop_s": machine.gemm_flop_s / 1e9,
    }
    return expected, note


def local_load_s(model) -> float:
    """Seconds of loading from local files: downloads, checks and conversions (first use) left out."""
    fetch = {k for k in model.resolved.seconds if k not in ("total", "resolve")} if model.resolved else set()
    return sum(v for k, v in model.load_seconds.items() if k not in fetch)


def summary(
    model, metrics, text: str, first_request: bool, others_cpu_share: float, load_others_cpu_share: float = float("nan")
) -> dict[str, Any]:
    """TTFT, TPOT, tokens/s, KV bytes, the memory tables, and the diagnosis: each phase measured
    against what it should take on this machine."""
    expected, calibration = expectations(model, metrics)
    history = list(model.history) + [metrics.rates()]  # this request is added after the summary
    weights = model.transformer.weights
    formats = weights.formats() if hasattr(weights, "formats") else {}  # stand-in models have none
    diagnosis = diagnose(
        metrics,
        expected=expected,
        history=history,
        weight_seconds=dict(getattr(model.transformer.weights, "seconds", {})),  # stand-in models have none
        load_s=local_load_s(model),
        warmup_s=model.warmup_s,
        first_request=first_request,
        text=text,
        special_tokens=model.tokenizer.special_token_texts,
        load_source=model.resolved.source if model.resolved else None,
        blas_threads=blas_threads(),
        others_cpu_share=others_cpu_share,
        load_others_cpu_share=load_others_cpu_share,
        held_formats=tuple(f for f in formats if f != "float32"),
    )
    params = model.transformer.weights.num_parameters
    return dict(
        load_s=model.load_s,
        warmup_s=model.warmup_s,
        **metrics.to_dict(),
        others_cpu_share=others_cpu_share,
        load_others_cpu_share=load_others_cpu_share,
        parameters=params,
        weight_bytes=weight_memory_table(params),
        weights_held=held_weight_table(formats) if formats else {},
        kv_bytes=kv_memory_table(model.config),
        context=model.config.max_position_embeddings,
        calibration=calibration,
        diagnosis={
            "dominant": diagnosis.dominant,
            "phase_seconds": diagnosis.phase_seconds,
            "checks": [[c.phase, c.measured_s, c.expected_s, c.ratio] for c in diagnosis.checks],
            "threshold": diagnosis.threshold,
            "findings": diagnosis.findings,
        },
    )
