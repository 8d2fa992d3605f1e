"""The CLI prints a MiniLLMError as one line without a traceback and exits 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400", "PYTHONPATH": str(ROOT), **env}, cwd=ROOT)


def test_cli_prints_the_error_without_a_traceback_and_exits_non_zero(tmp_path):
    proc = cli("run", "Hello", "--model", str(tmp_path / "nowhere"))
    assert proc.returncode == 2
    err = " ".join(proc.stderr.split())
    assert f"error: ModelNotFoundError: no such folder: {tmp_path / 'nowhere'}" in err
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    proc = cli("run", "", "--model", str(tmp_path))
    assert proc.returncode == 2 and "InvalidRequestError: the prompt is empty" in proc.stderr


def test_cli_debug_shows_the_traceback(tmp_path):
    proc = cli("run", "Hello", "--model", str(tmp_path / "nowhere"), "--debug")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "minillm.errors.ModelNotFoundError: no such folder" in proc.stderr


def test_cli_models_with_a_broken_manifest(tmp_path):
    (tmp_path / "m.toml").write_text("[models.x\n")
    proc = cli("models", MINILLM_MANIFEST=str(tmp_path / "m.toml"))
    assert proc.returncode == 2 and "ManifestError" in proc.stderr and "is not valid TOML" in proc.stderr
    assert "Traceback" not in proc.stderr
