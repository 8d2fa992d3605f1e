"""`minillm serve` as a child process, shared by the benchmarks that drive a server and the server
tests: a free port, waiting for ``/health``, and stopping the child (terminate, then kill).
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, done, proc: subprocess.Popen | None, log: Path | None, timeout: float = 120.0, verify=True):
    """Poll ``url + "/health"`` until ``done(response or None)`` holds; return that response. ``verify``:
    httpx's (an ``ssl.SSLContext`` that trusts an HTTPS server's own certificate).

    Raises RuntimeError if ``proc`` exits first (with its log), TimeoutError after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text() if log else ''}")
        try:
            r = httpx.get(url + "/health", timeout=2, verify=verify)
        except httpx.HTTPError:
            r = None
        if done(r):
            return r
        time.sleep(0.05)
    raise TimeoutError(f"server not ready after {timeout} s:\n{log.read_text() if log else ''}")


def ready(response) -> bool:
    """``/health`` answered 200: the model is loaded and warmed."""
    return response is not None and response.status_code == 200


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the server (it drains and exits), and SIGKILL it if it is still there after ``timeout`` s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
