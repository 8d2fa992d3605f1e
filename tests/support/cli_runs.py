"""The `minillm` command run as a user runs it (a subprocess from the repository's root), and the
phases of the trace it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import minillm

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, stdin: str | None = None, env=None, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", **(env or {})}  # rich wraps at COLUMNS: keep messages on one line
    return subprocess.run([sys.executable, "-m", "minillm", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def events(path: Path) -> dict:
    return {e.phase: e.data for e in minillm.Tracer.from_jsonl(path.read_text())}
