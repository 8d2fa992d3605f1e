"""Soak: thousands of mixed requests against ``minillm serve``, and whether anything grows.

    python -m benchmarks.soak                         # 2,000 requests, concurrency 8
    python -m benchmarks.soak --requests 300 --json /tmp/soak.json

It starts ``minillm serve`` on a free loopback port (``--request-timeout`` bounds every request,
``--test-faults`` lets a few ask for an injected bug), then sends ``--requests`` requests from
``--concurrency`` clients in phases of ``--phase`` requests. Each request is, by its number:
streamed or not, short or long, and one of: normal, cancelled mid-stream (the client closes it),
timing out (a budget the deadline cuts), invalid (a 400), or an injected fault (a 500).

After each phase, when the server is idle, it reads the server's RSS, open file descriptors and
threads (``/proc``), the KV blocks in use and the worker's request table (``/metrics``). It exits 1
when, at the end: KV blocks are still in use, the request table is not empty, threads or file
descriptors are more than after the first phase, RSS grew more than ``--rss-growth`` over RSS after the
first phase, or a 5xx came that was not an injected fault. Results go to
``benchmarks/results/local/soak.json`` (untracked) unless ``--json`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.server_process import free_port

DEFAULT_JSON = Path(__file__).parent / "results" / "local" / "soak.json"
MODEL = "smollm2-135m-instruct"
KINDS = ("normal", "normal", "cancel", "normal", "timeout", "invalid", "normal", "normal", "normal", "fault")


def _proc(pid: int) -> dict:
    """RSS bytes, open file descriptors and threads of process ``pid`` (Linux ``/proc``)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {
        "rss_bytes": int(status["VmRSS"].split()[0]) * 1024,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(status["Threads"]),
    }


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _body(i: int, kind: str) -> tuple[str, dict]:
    """The endpoint and body of request number ``i`` of this kind."""
    long = i % 3 == 0
    body = {"model": MODEL, "temperature": 0, "max_tokens": 24 if long else 6, "stream": i % 2 == 0}
    prompt = f"Request {i}: tell me about the number {i}." + (" Give details." * 40 if long else "")
    if kind == "invalid":
        body["temperature"] = 5.0  # out of range: a 400
    elif kind == "timeout":
        body["max_tokens"] = 4000  # the --request-timeout deadline cuts it
    elif kind == "cancel":
        body.update(stream=True, max_tokens=200)
    elif kind == "fault":
        body["minillm_test_fault"] = {"stage": ("sampler", "detokenizer", "stop")[i % 3], "at_token": 2}
    if i % 4 == 1:
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _one(client: httpx.Client, url: str, i: int, tally: Counter, lock: threading.Lock) -> None:
    kind = KINDS[i % len(KINDS)]
    path, body = _body(i, kind)
    try:
        if body["stream"]:
            with client.stream("POST", url + path, json=body) as r:
                status, lines = r.status_code, 0
                for line in r.iter_lines():
                    lines += line.startswith("data: ")
                    if kind == "cancel" and lines >= 3:
                        break  # leaving the block closes the connection mid-stream
                    if line.startswith('data: {"error"'):
                        status = 500
        else:
            status = client.post(url + path, json=body).status_code
        outcome = f"{kind} {status // 100}xx"
    except httpx.HTTPError as exc:
        outcome = f"{kind} {type(exc).__name__}"
    with lock:
        tally[outcome] += 1


def _phase(url: str, start: int, n: int, concurrency: int, tally: Counter) -> None:
    lock, numbers = threading.Lock(), iter(range(start, start + n))

    def client_loop():
        with httpx.Client(timeout=120) as client:
            for i in numbers:  # shared iterator: each number once (next() holds the GIL)
                _one(client, url, i, tally, lock)

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _settled(pid: int, fds: int | None, timeout: float = 5.0) -> dict:
    """``_proc(pid)``, once the file descriptors are back to ``fds`` (closed client connections take
    a moment to reach the server) or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        now = _proc(pid)
        if fds is None or now["fds"] <= fds or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def _idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    """/metrics once no request runs or waits (a cancelled one ends at the next step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        busy = m["minillm_num_requests_running"] + m["minillm_num_requests_waiting"] + m["minillm_requests_tracked"]
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def _start(args) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = args.json.with_suffix(".server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "minillm", "serve", args.model, "--port", str(port), "--threads", str(args.threads),
           "--verbosity", "quiet", "--test-faults", "--request-timeout", str(args.request_timeout),
           ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not become ready:\n{log.read_text()}")


def _verdict(rows: list[dict], tally: Counter, rss_growth: float, start: dict | None = None) -> list[str]:
    """What grew or went wrong: an empty list means the soak passed. ``start``: the server's threads
    and descriptors before the first request (a count above both it and the first phase's is a leak)."""
    first, last = rows[0], rows[-1]
    problems = [f"{k}: {v}" for k, v in tally.items() if " 5xx" in k and not k.startswith("fault")]
    problems += [f"{k}: {v}" for k, v in tally.items() if "Error" in k and not k.startswith("cancel")]
    if any(r["blocks_used"] != 0 for r in rows):
        problems.append(f"KV blocks in use between phases: {[r['blocks_used'] for r in rows]}")
    if last["tracked"] != 0:
        problems.append(f"the worker still tracks {last['tracked']} requests")
    for key in ("threads", "fds"):
        # fewer is no leak (a client connection may close a moment later): only a count above both the
        # start's and the first phase's is one
        if last[key] > max(first[key], (start or first)[key]):
            problems.append(f"{key}: {first[key]} after the first phase, {last[key]} at the end")
    if last["rss_bytes"] > first["rss_bytes"] * (1 + rss_growth):
        problems.append(f"RSS grew {last['rss_bytes'] / first['rss_bytes'] - 1:.1%} (limit {rss_growth:.0%})")
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--phase", type=int, default=200, help="requests between two measurements")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=2.0, metavar="SECONDS")
    p.add_argument("--rss-growth", type=float, default=0.05, help="allowed RSS growth after the first phase")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)

    proc, url, log = _start(args)
    tally: Counter = Counter()
    rows = []
    try:
        m = _idle(url)
        start_row = _proc(proc.pid)
        start_fds = start_row["fds"]
        print(f"start: {start_row}, KV blocks in use {m['minillm_kv_cache_blocks_used']:.0f}")
        for start in range(0, args.requests, args.phase):
            n = min(args.phase, args.requests - start)
            _phase(url, start, n, args.concurrency, tally)
            m = _idle(url)
            row = {"requests": start + n, **_settled(proc.pid, start_fds)}
            row.update(blocks_used=int(m["minillm_kv_cache_blocks_used"]), tracked=int(m["minillm_requests_tracked"]))
            rows.append(row)
            print(
                f"after {row['requests']:5d}: RSS {row['rss_bytes'] / 2**20:7.1f} MiB, fds {row['fds']}, "
                f"threads {row['threads']}, KV blocks in use {row['blocks_used']}, tracked {row['tracked']}"
            )
        failed = {k: v for k, v in m.items() if k.startswith("minillm_request_failed_by_bug_total")}
    finally:
        proc.terminate()
        code = proc.wait(timeout=60)
    problems = _verdict(rows, tally, args.rss_growth, start_row)
    print("outcomes:", dict(sorted(tally.items())))
    print("bug counter:", failed, "; server exit status", code)
    print("PASS" if not problems else "FAIL: " + "; ".join(problems))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {"phases": rows, "outcomes": dict(tally), "failed_by_bug": failed, "exit": code, "problems": problems}
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json} (server log {log})")
    return 1 if problems or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
