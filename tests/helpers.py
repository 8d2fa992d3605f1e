"""Small helpers shared by test modules (imported as ``from helpers import ...``; tests/ is on sys.path)."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
from pathlib import Path


def run_bench(url: str, model: str, out: Path, *, concurrency: str, requests: int, prompt_tokens: int,
              max_tokens: int) -> subprocess.CompletedProcess:
    """Run ``python -m minillm bench`` against ``url`` the way a user would (a subprocess, 160
    columns, results written as JSON to ``out``); return the finished process, output captured as text.
    The caller asserts on its return code: a failed bench is a test's finding, not an exception here."""
    cmd = [sys.executable, "-m", "minillm", "bench", "--url", url, "--model", model, "--concurrency", concurrency,
           "--requests", str(requests), "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(max_tokens),
           "--json", str(out)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "COLUMNS": "160"})


def release_memory() -> None:
    """Collect dropped objects (cycles included) and hand the freed heap back to the system: glibc
    keeps freed small blocks otherwise, and the RSS budget (tests/rss_budget.py) counts them."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory is still free for this process
        pass
