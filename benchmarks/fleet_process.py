"""`minillm deploy` as a subprocess, for the deploy tests and lesson 18: started in a session of its own
and told to stop (SIGINT: the replicas drain, Serve and Ray stop) when its parent dies, so a test or a
lesson that fails midway leaves no Ray cluster behind; stopped and checked for leftover processes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies (Linux)


def _stop_with_parent() -> None:
    """In the child, before exec: SIGINT when the parent dies (nothing where prctl is missing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGINT)
    except (OSError, AttributeError):
        pass


def start_deploy(flags: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """``python -m minillm deploy FLAGS`` writing to ``log``; ``env``: its variables (default this process's)."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "minillm", "deploy", *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**(os.environ if env is None else env), "COLUMNS": "200", "RAY_DEDUP_LOGS": "0"},
            start_new_session=True,  # its own process group: whatever Ray leaves can be found and ended
            preexec_fn=_stop_with_parent,
        )


def family(proc: subprocess.Popen) -> list[int]:
    """The pids of ``proc`` and all its descendants now (the command, Ray's processes, the replicas)."""
    return [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]


def stop_deploy(proc: subprocess.Popen, pids: list[int], timeout: float = 90.0) -> tuple[int, list[int]]:
    """SIGINT ``proc`` and wait (SIGKILL to its group after ``timeout`` s); then SIGKILL any of ``pids``
    still alive after 15 s. Returns (exit status, the pids that had to be killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline, left = time.monotonic() + 15.0, []
    while time.monotonic() < deadline:
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not left:
            break
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, left
