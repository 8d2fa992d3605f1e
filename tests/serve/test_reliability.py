"""`minillm serve` when things go wrong (issue 30): it drains, sheds, isolates faults and never leaks.

Each test starts the server as a subprocess (``test_serve.running_server``) and talks to it with the
official `openai` client, httpx, or a raw socket (the slow reader). Every assert is on texts, counts,
statuses and exit codes; the one timing (the other streams' TPOT beside a slow reader) is asserted
only when other processes kept less than half a core busy (``calibrate.BUSY_CORES``).

The diagnosis calibration is seeded as measured on a quiet machine: on a busy one (CI) every
server would measure it again during its warm-up (it is never kept from a busy machine), seconds
per server start that have nothing to do with what these tests check.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import httpx
import pytest
from servers import MODEL, SERVERS, free_port, metrics, wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    import threadpoolctl

    from minillm.observe import calibrate

    path = tmp_path_factory.mktemp("calibration") / "rates.json"
    with threadpoolctl.threadpool_limits(1):  # the servers run with --threads 1
        m = replace(calibrate.measure_machine(), others_cpu_share=0.0)
        key = calibrate.fingerprint_key(calibrate.fingerprint())
    path.write_text(json.dumps({"schema": calibrate.SCHEMA, "machines": {key: asdict(m)}}))
    return path


def start(tmp_path: Path, calibration: Path, *flags: str):
    """(process, url, log path) of a ready server; the caller stops it."""
    import os

    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "minillm", "serve", MODEL, "--port", str(port), "--threads", "1",
           "--verbosity", "quiet", *flags]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "MINILLM_CALIBRATION": str(calibration)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_for(url, lambda r: r is not None and r.status_code == 200, proc, log)
    return proc, url, log


def stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def openai_client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


PROMPTS = [f"Story {i}: Once upon a time" for i in range(4)]


def stream_text(client, prompt: str, max_tokens: int, **extra) -> tuple[str, str | None, str | None]:
    """(text, finish_reason, minillm_stop_reason) of one streamed completion."""
    parts, finish, reason = [], None, None
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, **extra
    ):
        c = chunk.choices[0]
        parts.append(c.text)
        finish = c.finish_reason or finish
        reason = getattr(c, "minillm_stop_reason", None) or reason
    return "".join(parts), finish, reason


def in_threads(fn, args_list):
    results, errors = {}, {}

    def run(i, args):
        try:
            results[i] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - kept for the assert
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    return threads, results, errors


# --- graceful shutdown ---------------------------------------------------------------------------
def test_sigterm_drains_four_streams_refuses_new_ones_and_exits_0(tmp_path, calibration):
    proc, url, log = start(tmp_path, calibration, "--shutdown-timeout", "120")
    try:
        client = openai_client(url)
        undisturbed = [stream_text(client, p, 30) for p in PROMPTS]
        threads, results, errors = in_threads(lambda p: stream_text(client, p, 30), [(p,) for p in PROMPTS])
        deadline = time.monotonic() + 60
        while metrics(url)["minillm_num_requests_running"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        health = httpx.get(url + "/health")
        late = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        for t in threads:
            t.join()
        code = proc.wait(timeout=120)
    finally:
        stop(proc)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert late.status_code == 503 and late.headers["retry-after"] == "1"
    assert late.json()["error"]["code"] == "draining" and late.json()["error"]["type"] == "service_unavailable"
    assert errors == {}
    assert [results[i] for i in range(4)] == undisturbed
    assert all(finish == "length" for _, finish, _ in undisturbed)
    assert code == 0
    text = log.read_text()
    drained = [line for line in text.splitlines() if line.strip().startswith("drained ")]
    assert len(drained) == 4 and all("max new tokens, 30 tokens" in line for line in drained), text
    assert "drained 4 requests (4 finished, 0 cancelled or failed)" in text


@pytest.mark.parametrize("served", list(SERVERS))
def test_past_the_shutdown_timeout_requests_are_cancelled_with_the_reason(tmp_path, calibration, served):
    """One model or several (``servers.SERVERS``): past the timeout the stream ends with finish_reason
    "abort" and [DONE] (the client's loop ends without an error), and the log names the cancellation.
    (The several-model server's slots never checked the drain's reason: the stream ran on past the
    timeout until the process exited under it, with no finish reason and nothing logged.)"""
    proc, url, log = start(tmp_path, calibration, "--shutdown-timeout", "1", *SERVERS[served])
    try:
        client = openai_client(url)
        threads, results, errors = in_threads(lambda: stream_text(client, "Once upon a time", 3000), [()])
        deadline = time.monotonic() + 60
        while metrics(url)["minillm_num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # some text streamed
        proc.send_signal(signal.SIGTERM)
        threads[0].join()
        code = proc.wait(timeout=60)
    finally:
        stop(proc)
    assert errors == {}
    text, finish, reason = results[0]
    assert finish == "abort" and reason == "cancelled" and text
    assert code == 0
    assert "cancelled (server shutting down: --shutdown-timeout 1 s passed)" in log.read_text()
    assert "drained 1 requests (0 finished, 1 cancelled or failed)" in log.read_text()


def test_a_second_signal_exits_at_once_with_status_1(tmp_path, calibration):
    proc, url, log = start(tmp_path, calibration, "--shutdown-timeout", "600")
    try:
        client = openai_client(url)
        threads, results, errors = in_threads(lambda: stream_text(client, "Once upon a time", 3000), [()])
        deadline = time.monotonic() + 60
        while metrics(url)["minillm_num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)  # the stream of 3,000 tokens and the 600 s timeout are not waited for
        threads[0].join()
    finally:
        stop(proc)
    assert code == 1
    assert 0 in errors  # its stream was cut
    assert "SIGTERM again: exiting now, 1 requests cut" in log.read_text()


def test_a_multi_model_server_drains_on_sigterm_and_refuses_a_large_body_with_413(tmp_path, calibration):
    """`minillm serve A --model B` starts as the one-model server does (server.serve_app): the same
    body limit, in OpenAI's shape and counted, and the same drain (its own uvicorn.run had neither:
    the body limit stayed 4 MiB and SIGTERM closed the socket under new clients)."""
    flags = ("--model", MODEL + ":int8", "--max-seq-len", "512", "--kv-cache-mib", "32",
             "--max-request-bytes", "2000", "--shutdown-timeout", "120")  # fmt: skip
    proc, url, log = start(tmp_path, calibration, *flags)
    try:
        client = openai_client(url)
        big = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a" * 3000, "max_tokens": 2})
        refused = metrics(url)["minillm_request_refused_at_admission_total{reason=body_too_large}"]
        undisturbed = [stream_text(client, p, 30) for p in PROMPTS[:2]]
        threads, results, errors = in_threads(lambda p: stream_text(client, p, 30), [(p,) for p in PROMPTS[:2]])
        deadline = time.monotonic() + 60
        while metrics(url)["minillm_num_requests_running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        late = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        for t in threads:
            t.join()
        code = proc.wait(timeout=120)
    finally:
        stop(proc)
    assert big.status_code == 413, big.text
    error = big.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "at most 2,000 bytes" in error["message"] and "--max-request-bytes" in error["message"]
    assert refused == 1
    assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
    assert errors == {} and [results[0], results[1]] == undisturbed
    assert code == 0
    assert "drained 2 requests (2 finished, 0 cancelled or failed)" in log.read_text()


# --- --max-queue while a job is being admitted (issue 41) ------------------------------------------
def wait_until(url: str, name: str, at_least: float, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while metrics(url).get(name, 0) < at_least:
        assert time.monotonic() < deadline, f"{name} never reached {at_least}"
        time.sleep(0.02)


@pytest.mark.parametrize("several", [(), ("--keep-alive", "-1")], ids=["one-model", "several-model"])
def test_a_request_being_admitted_counts_against_max_queue(tmp_path, calibration, several):
    """--max-num-seqs 1 --max-queue 1, three requests. A runs; B has left the queue, is prepared and
    not yet in the scheduler (the test hook holds it there until another request arrives); C comes:
    B is the one request allowed to wait, so C gets 429. (B was counted nowhere: C was queued and
    answered 200, one request too many.) The several-model server's slots are the same worker."""
    proc, url, log = start(tmp_path, calibration, "--test-faults", "--max-queue", "1", "--max-num-seqs", "1", *several)
    picked = "minillm_request_queue_time_seconds_count"  # observed as the worker takes a job from the queue
    try:
        client = openai_client(url)
        hold = {"minillm_test_fault": {"stage": "admission", "hold_s": 120}}
        threads, results, errors = in_threads(lambda p: stream_text(client, p, 40), [(PROMPTS[0],)])
        wait_until(url, picked, 1)  # A was taken (it runs, or already ran)
        more, held, held_errors = in_threads(lambda p: stream_text(client, p, 8, extra_body=hold), [(PROMPTS[1],)])
        wait_until(url, picked, 2)  # B left the queue: the hook holds it until C arrives
        c = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 8})
        for t in threads + more:
            t.join()
        after = metrics(url)
    finally:
        stop(proc)
    assert errors == {} and held_errors == {}, (errors, held_errors)
    assert results[0][1] == "length" and held[0][1] == "length"  # A and B answered in full (200)
    assert c.status_code == 429 and c.headers["retry-after"] == "1", c.text
    assert c.json() == {"error": {"message": "server busy: 1 request is already waiting; retry after 1 s",
                                  "type": "rate_limit_error", "param": None, "code": "queue_full"}}  # fmt: skip
    assert after["minillm_request_rejected_total"] == 1
    assert after["minillm_request_finished_total{reason=max new tokens}"] == 2


def test_the_fault_field_is_refused_without_the_flag(tmp_path, calibration):
    proc, url, _ = start(tmp_path, calibration)
    try:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                      "minillm_test_fault": {"stage": "sampler"}})  # fmt: skip
    finally:
        stop(proc)
    assert r.status_code == 400 and "--test-faults" in r.json()["error"]["message"]


# --- soak -------------------------------------------------------------------------------------------
def test_a_300_request_soak_leaks_no_blocks_threads_or_descriptors(tmp_path, calibration):
    """benchmarks/soak.py at 300 requests: counts only (blocks in use 0 after every phase, the
    request table empty, threads and fds as after the first phase, no 5xx but the injected ones)."""
    import os

    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--requests", "300", "--phase", "100",
                          "--rss-growth", "1.0", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "MINILLM_CALIBRATION": str(calibration)}, timeout=1800)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert [r["blocks_used"] for r in result["phases"]] == [0, 0, 0]
    assert [r["tracked"] for r in result["phases"]] == [0, 0, 0]
    first = result["phases"][0]
    counts = [(r["threads"], r["fds"]) for r in result["phases"]]
    assert all(r["threads"] <= first["threads"] for r in result["phases"]), counts
    # one descriptor more than after the first phase is a client connection still closing (the soak's
    # own verdict, which passed above, also allows the count before the first request); a leak adds one
    # per cancelled or failed request: 10 a phase
    assert all(r["fds"] <= first["fds"] + 1 for r in result["phases"]), counts
    assert sum(result["outcomes"].values()) == 300
    assert not [k for k in result["outcomes"] if "5xx" in k and not k.startswith("fault")]
    assert result["exit"] == 0


# --- faults, backpressure, limits: one server, last (the tests above start servers of their own; a module
# fixture lives until the module ends, so one started earlier would run beside each of theirs) -----------
@pytest.fixture(scope="module")
def fault_server(tmp_path_factory, calibration):
    proc, url, log = start(tmp_path_factory.mktemp("faults"), calibration, "--test-faults", "--stream-buffer", "8")
    yield url, log, proc.pid
    stop(proc)


def test_an_injected_fault_ends_only_its_request(fault_server):
    import openai

    url, *_ = fault_server
    client = openai_client(url)
    prompts = [f"Story {i}: Once upon a time" for i in range(8)]

    def ask(i: int, fault: dict | None = None):
        extra = {"extra_body": {"minillm_test_fault": fault}} if fault else {}
        out = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0, **extra)
        return out.choices[0].text

    alone = [ask(i) for i in range(8)]
    assert all(alone)  # text, so the fault at token 4 is reached
    before = metrics(url)
    fault = {"stage": "detokenizer", "at_token": 4}
    threads, results, errors = in_threads(ask, [(i, fault if i == 5 else None) for i in range(8)])
    for t in threads:
        t.join()
    after = metrics(url)
    assert set(errors) == {5} and isinstance(errors[5], openai.InternalServerError)
    message = str(errors[5])
    assert "a bug in minillm ended this request in its detokenizer" in message and "InjectedFault" in message
    assert [results[i] for i in range(8) if i != 5] == [alone[i] for i in range(8) if i != 5]
    key = 'minillm_request_failed_by_bug_total{stage=detokenizer}'
    assert after[key] - before.get(key, 0) == 1
    key = "minillm_request_finished_total{reason=error}"  # its final state, counted once like every other
    assert after[key] - before.get(key, 0) == 1
    assert ask(5) == alone[5]  # the worker serves the next request
    assert after["minillm_worker_alive"] == 1 and after["minillm_kv_cache_blocks_used"] == 0
    assert after["minillm_requests_tracked"] == 0


def test_a_fault_after_text_was_streamed_ends_the_stream_with_an_error(fault_server):
    import openai

    url, *_ = fault_server
    client = openai_client(url)
    with pytest.raises(openai.APIError, match="in its stop chain"):
        stream_text(client, "Once upon a time", 20, extra_body={"minillm_test_fault": {"stage": "stop", "at_token": 5}})
    fault = {"stage": "sampler", "at_token": 1}
    r = httpx.post(url + "/v1/completions",
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "minillm_test_fault": fault})  # fmt: skip
    assert r.status_code == 500 and r.json()["error"]["code"] == "minillm_bug"
    assert "in its sampler" in r.json()["error"]["message"]


def stream_timed(client, prompt: str, max_tokens: int) -> tuple[str, float]:
    """(text, TPOT in seconds at the client: between its first and last chunks with text, per gap)."""
    parts, times = [], []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True):  # fmt: skip
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
            times.append(time.perf_counter())
    return "".join(parts), (times[-1] - times[0]) / max(1, len(times) - 1)


def rounds_of_four(client, seconds: float) -> list[list[tuple[str, float]]]:
    """The 4 prompts streamed together (40 tokens each), round after round for ``seconds``."""
    out, end = [], time.monotonic() + seconds
    while not out or time.monotonic() < end:
        threads, results, errors = in_threads(lambda p: stream_timed(client, p, 40), [(p,) for p in PROMPTS])
        for t in threads:
            t.join()
        assert errors == {}, errors
        out.append([results[i] for i in range(4)])
    return out


class Neighbours:
    """Cores other processes kept busy meanwhile (not this one, not the server: ``pid``)."""

    def __init__(self, pid: int):
        import psutil

        self.server = psutil.Process(pid)

    def __enter__(self):
        from minillm.observe.metrics import cpu_snapshot

        self.before, self.server_before = cpu_snapshot(), sum(self.server.cpu_times()[:2])
        return self

    def __exit__(self, *exc):
        import os

        from minillm.observe.metrics import cpu_snapshot, others_cpu_share

        wall, busy, own = cpu_snapshot()
        server = sum(self.server.cpu_times()[:2]) - self.server_before
        self.cores = others_cpu_share(self.before, (wall, busy - server, own)) * os.cpu_count()


def test_a_slow_reader_is_shed_and_the_others_keep_their_tokens_and_tpot(fault_server):
    """A client reading one byte a second for 20 s while 4 others stream, round after round: theirs
    are the tokens of an undisturbed run (always) and their TPOT within 1.5 times that of the same
    4 streams without it (on a quiet machine); the slow one ends cancelled with the reason, counted."""
    from statistics import median

    from minillm.observe.calibrate import BUSY_CORES

    url, _, pid = fault_server
    client = openai_client(url)
    undisturbed = [stream_text(client, p, 40)[0] for p in PROMPTS]
    with Neighbours(pid) as quiet_run:
        alone = rounds_of_four(client, 0)
    before = metrics(url)["minillm_request_shed_by_backpressure_total"]
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0,
                       "stream": True, "stop": "zqzqzq"}).encode()  # fmt: skip
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    slow.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    response_head = b""
    while b"\r\n\r\n" not in response_head:
        response_head += slow.recv(1)
    rid = next(line.split(":", 1)[1].strip() for line in response_head.decode().splitlines()
               if line.lower().startswith("x-request-id"))  # fmt: skip
    disturbed = []
    with Neighbours(pid) as busy_run:
        others = threading.Thread(target=lambda: disturbed.extend(rounds_of_four(client, 20.0)))
        others.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20.0 or (
            metrics(url)["minillm_request_shed_by_backpressure_total"] == before and time.monotonic() - t0 < 300
        ):
            slow.recv(1)  # one byte a second
            time.sleep(1.0)
        others.join()
    slow.close()
    assert metrics(url)["minillm_request_shed_by_backpressure_total"] - before == 1
    assert disturbed and all([text for text, _ in r] == undisturbed for r in disturbed + alone)
    trace = httpx.get(f"{url}/v1/traces/{rid}").json()
    stop_event = next(e for e in trace["events"] if e["phase"] == "stop")
    assert stop_event["data"]["reason"] == "cancelled"
    assert "the client read too slowly" in stop_event["data"]["condition"]
    assert "(--stream-buffer 8)" in stop_event["data"]["condition"]
    ratio = median(t for r in disturbed for _, t in r) / median(t for r in alone for _, t in r)
    print(f"TPOT with the slow reader / without: {ratio:.2f} ({len(disturbed)} rounds; other processes kept "
          f"{quiet_run.cores:.1f} and {busy_run.cores:.1f} cores busy)")
    if max(quiet_run.cores, busy_run.cores) < BUSY_CORES:  # timings are the server's own only on a quiet machine
        assert ratio < 1.5


def test_limits_refuse_in_openai_shape_before_model_work(fault_server):
    url, *_ = fault_server
    before = metrics(url)
    big = httpx.post(url + "/v1/completions", content=b'{"model": "x", "prompt": "' + b"a" * (5 * 2**20) + b'"}',
                     headers={"content-type": "application/json"})  # fmt: skip
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    message = big.json()["error"]["message"]
    assert "4,194,304 bytes" in message and "--max-request-bytes" in message
    long = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "word " * 400_000, "max_tokens": 2})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    message = long.json()["error"]["message"]
    assert "2,000,000 bytes" in message and "it was not tokenized" in message
    deep = '{"model": "' + MODEL + '", "prompt": "Hi", "stop": ' + "[" * 100_000 + "]" * 100_000 + "}"
    json_type = {"content-type": "application/json"}
    assert httpx.post(url + "/v1/completions", content=deep, headers=json_type).status_code == 400
    too_many = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 10_000})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    after = metrics(url)
    for reason in ("body_too_large", "prompt_too_long"):
        key = f"minillm_request_refused_at_admission_total{{reason={reason}}}"
        assert after[key] - before.get(key, 0) == 1
    assert after["minillm_prompt_tokens_total"] == before["minillm_prompt_tokens_total"]
