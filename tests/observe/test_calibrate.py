"""A calibration measured on a busy machine is flagged and never kept as the machine's rates
(``minillm/observe/calibrate.py``); the test run never reads a user's cached calibration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from minillm.observe import calibrate

SPIN = "while True: pass"


def test_the_run_measures_into_a_file_of_its_own():
    # conftest points the calibration at a temporary file: no test depends on ~/.cache's figures
    assert os.environ["MINILLM_CALIBRATION"] == str(calibrate.calibration_file())
    assert Path.home() not in calibrate.calibration_file().parents


def test_calibration_under_spinners_is_flagged_and_not_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CALIBRATION", str(tmp_path / "rates.json"))
    # One spinner per core, so the neighbours fill the machine whatever its size.
    monkeypatch.setattr(calibrate, "_BUSY", {})  # as a new process starts
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)  # the spinners are running before the measurement starts
        first = calibrate.machine()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert first.busy and first.others_cores >= calibrate.BUSY_CORES, first.others_cores
    assert not (tmp_path / "rates.json").exists()  # never kept as this machine's
    assert calibrate.machine() is first  # this process does not pause to measure again
    monkeypatch.setattr(calibrate, "_BUSY", {})  # the next process
    measured = []
    second = calibrate.machine(on_measure=lambda: measured.append(True))
    assert measured == [True] and second is not first  # measured again, the busy figures not reused


def fake_measurement(others_cpu_share: float) -> calibrate.Machine:
    return calibrate.Machine(
        fingerprint=calibrate.fingerprint(), matmul_s_per_byte={"1": 1e-10}, gemm_flop_s=1e11,
        fresh_copy_b_s=1e9, disk_read_b_s=1e9, tokenizer_b_s=1e8, call_s=1e-6,
        others_cpu_share=others_cpu_share, measured_at="now",
    )


def test_only_a_quiet_measurement_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CALIBRATION", str(tmp_path / "rates.json"))
    cores = os.cpu_count() or 1
    quiet, busy = fake_measurement(0.4 / cores), fake_measurement(0.5 / cores)  # 0.4 and 0.5 cores
    assert not quiet.busy and busy.busy  # the boundary: half a core is busy

    measurements = iter([busy, quiet])
    monkeypatch.setattr(calibrate, "measure_machine", lambda: next(measurements))
    monkeypatch.setattr(calibrate, "_BUSY", {})
    assert calibrate.machine() is busy and not (tmp_path / "rates.json").exists()
    assert calibrate.machine() is busy  # this process keeps it ...
    monkeypatch.setattr(calibrate, "_BUSY", {})  # ... the next one measures again
    assert calibrate.machine() is quiet
    key = calibrate.fingerprint_key(calibrate.fingerprint())
    kept = json.loads((tmp_path / "rates.json").read_text())["machines"][key]
    assert kept["others_cpu_share"] == quiet.others_cpu_share
    assert calibrate.machine() == quiet  # now read from the file


def test_a_busy_entry_in_the_file_is_measured_over(tmp_path, monkeypatch):
    # a file written by an older minillm that kept busy measurements
    monkeypatch.setenv("MINILLM_CALIBRATION", str(tmp_path / "rates.json"))
    from dataclasses import asdict

    old = fake_measurement(1.0)
    key = calibrate.fingerprint_key(calibrate.fingerprint())
    (tmp_path / "rates.json").write_text(json.dumps({"schema": calibrate.SCHEMA, "machines": {key: asdict(old)}}))
    fresh = replace(fake_measurement(0.0), measured_at="later")
    monkeypatch.setattr(calibrate, "measure_machine", lambda: fresh)
    monkeypatch.setattr(calibrate, "_BUSY", {})
    assert calibrate.machine() is fresh


# --- the model's own products: a last-level cache that holds the machine's matrix -------------------
def test_the_decode_expectation_streams_at_the_slower_of_the_machines_and_the_models_rate():
    # by hand: 1e9 matrix bytes, 1e6 KV bytes, 30 layers x 120 calls at 1 us; the machine streams at
    # 1e-11 s/byte (100 GB/s, its 96 MiB matrix in a large cache), the model's own products at 4e-11
    m = calibrate.Machine(fingerprint={}, matmul_s_per_byte={"1": 1e-11, "64": 1e-11}, gemm_flop_s=1e12,
                          fresh_copy_b_s=1e9, disk_read_b_s=1e9, tokenizer_b_s=1e9, call_s=1e-6)
    sizes = {"matmul_bytes": 10**9, "kv_bytes_per_token": 1000, "layers": 30}
    assert calibrate.CALLS_PER_LAYER == 120
    assert abs(calibrate.expected_tpot_s(sizes, m, 1000) - (0.01 + 1e-5 + 0.0036)) < 1e-12  # the machine alone
    assert abs(calibrate.expected_tpot_s(sizes, m, 1000, 4e-11) - (0.04 + 1e-5 + 0.0036)) < 1e-12
    assert calibrate.expected_tpot_s(sizes, m, 1000, 1e-12) == calibrate.expected_tpot_s(sizes, m, 1000)  # never faster


def test_the_models_products_rate_is_measured_once_per_thread_count_and_not_for_packed_weights(folder):
    import minillm
    from minillm.kernels.products import blas_threads
    from minillm.observe.products_rate import products_s_per_byte

    model = minillm.load(folder, progress=False, warmup=False)
    rate = products_s_per_byte(model)
    assert rate > 0 and model.products_s_per_byte == {blas_threads(): rate}
    assert products_s_per_byte(model) == rate  # kept: not measured again
    packed = minillm.load(folder, progress=False, warmup=False, weight_dtype="int8")
    assert products_s_per_byte(packed) is None  # its products unpack: the machine's rate is the expectation


# --- measured during the warm-up, not in a request's step (issue 41) -------------------------------
def test_a_traced_warm_up_measures_what_the_first_requests_diagnosis_reads(folder, tmp_path, monkeypatch):
    """``minillm run`` loads with a tracer and a warm-up: the warm-up measures the machine (from no
    file) and the model's products rate; the first request's summary then measures nothing."""
    import minillm

    monkeypatch.setenv("MINILLM_CALIBRATION", str(tmp_path / "rates.json"))  # not calibrated yet
    monkeypatch.setattr(calibrate, "_BUSY", {})
    measured = []

    def measure():  # a quiet machine's figures, counted (the real one takes seconds)
        measured.append(True)
        return fake_measurement(0.0)

    monkeypatch.setattr(calibrate, "measure_machine", measure)
    products = len([m for m in calibrate.MEASUREMENTS if m["what"] == "products_rate"])
    tracer = minillm.Tracer()
    model = minillm.load(folder, tracer=tracer, progress=False)  # warm-up on, as `minillm run` loads
    warmup = next(e.data for e in tracer.events if e.phase == "warmup")
    assert warmup["calibration"]["measured_now"] is True and measured == [True]
    after_load = len([m for m in calibrate.MEASUREMENTS if m["what"] == "products_rate"])
    assert after_load == products + 1  # the model's own products, timed in the warm-up
    request = minillm.Tracer()
    minillm.generate(model, "hello", minillm.SamplingParams(temperature=0.0), tracer=request, max_new_tokens=2)
    summary = request.events[-1].data
    assert summary["calibration"]["measured_now"] is False and measured == [True]  # the machine: not again
    assert len([m for m in calibrate.MEASUREMENTS if m["what"] == "products_rate"]) == after_load  # nor the model
