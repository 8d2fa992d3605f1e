"""`minillm deploy` as a subprocess, the way the deploy tests meet it: a free port, start the local Ray
cluster and the replicas, wait for the "ready" line, read the replica counts it prints from Ray Serve's
status, stop it (SIGINT: the replicas drain, Serve and Ray stop), and check that no Ray process is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

from benchmarks.server_process import free_port

#: The model every deploy test serves (as the server tests).
MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 300.0  # Ray's start and two loads on a busy 2-core machine
STOP_TIMEOUT_S = 90.0


@contextmanager
def running_deployment(tmp_path: Path, *flags: str, model: str | None = MODEL, env=None):
    """Start ``python -m minillm deploy [MODEL] --port P --threads 1 FLAGS``; yield (process, base url,
    log path) once it printed "ready"; then stop it and its Ray cluster, and fail if a process of it
    is still alive."""
    port = free_port()
    log = tmp_path / f"deploy-{port}.log"
    cmd = [sys.executable, "-m", "minillm", "deploy", *([model] if model else []), "--port", str(port), *flags]
    if "--config" not in flags:
        cmd += ["--threads", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200", "RAY_DEDUP_LOGS": "0", **(env or {})},
            start_new_session=True,  # its own process group: whatever Ray leaves can be found and ended
        )
    family = [proc.pid]
    try:
        wait_for_line(log, r"minillm deploy: ready on", proc, START_TIMEOUT_S)
        family = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        stop_deployment(proc, family)


def wait_for_line(log: Path, pattern: str, proc: subprocess.Popen | None, timeout: float, after: int = 0) -> str:
    """Wait until a line of ``log`` (from character ``after``) matches ``pattern``; return the line.

    Raises RuntimeError if ``proc`` exits first (with the log's end), TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()[after:]
        found = re.search(f"^.*{pattern}.*$", text, re.MULTILINE)
        if found:
            return found.group(0)
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"minillm deploy exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"no line matching {pattern!r} after {timeout:g} s:\n{log.read_text()[-4000:]}")


def stop_deployment(proc: subprocess.Popen, family: list[int]) -> None:
    """SIGINT ``proc`` (it stops the replicas, Serve and Ray) and wait; then end any process of
    ``family`` (the pids it had when ready) still alive and fail the test naming it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = []
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline:
        left = [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not left:
            return
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise AssertionError(f"minillm deploy left processes behind: {left}")


def replica_counts(log: Path) -> list[int]:
    """The running replica counts the command printed from Ray Serve's status, in order."""
    said = r"minillm deploy: (?:ready on \S+ \(|replicas |rolled: replicas )[^\n]*?\brunning (\d+)"
    return [int(n) for n in re.findall(said, log.read_text())]


def tree_rss(pid: int) -> int:
    """Bytes resident in ``pid`` and all its descendants now."""
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)] if p.is_running())
