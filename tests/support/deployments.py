"""`minillm deploy` as a subprocess, the way the deploy tests meet it: a free port, start the local Ray
cluster and the replicas, wait for the "ready" line, read the replica counts it prints from Ray Serve's
status, stop it (SIGINT: the replicas drain, Serve and Ray stop), and check that no Ray process is left.
"""

from __future__ import annotations

import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks.fleet_process import family, start_deploy, stop_deploy
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
    flags = (*([model] if model else []), "--port", str(port), *flags)
    if "--config" not in flags:
        flags = (*flags, "--threads", "1")
    proc = start_deploy(list(flags), log, env)
    pids = [proc.pid]
    try:
        wait_for_line(log, r"minillm deploy: ready on", proc, START_TIMEOUT_S)
        pids = family(proc)
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        _, left = stop_deploy(proc, pids, STOP_TIMEOUT_S)
        assert left == [], f"minillm deploy left processes behind: {left}"


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


def replica_counts(log: Path) -> list[int]:
    """The running replica counts the command printed from Ray Serve's status, in order."""
    said = r"minillm deploy: (?:ready on \S+ \(|replicas |config applied: replicas )[^\n]*?\brunning (\d+)"
    return [int(n) for n in re.findall(said, log.read_text())]
