"""The ``minillm`` command's rough edges (issue 32): missing extras, a closed or busy port, the
context-window sentence, a base model refused by ``chat`` before any download, an attached document
printed once, ``--version``, ``bench --help``'s defaults, ``minillm cache`` and the distribution's name.

Fast: no real model. The CLI runs in process with ``minillm.load`` replaced by the scripted model
(tests/support/scripted.py), or as a subprocess where the behaviour is the process's (ports, exit status).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from scripted import scripted_model, word_tokenizer_folder

import minillm
from minillm.cli import main
from minillm.errors import DISTRIBUTION, ContextWindowExceeded, ManifestError
from minillm.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def run_cli(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "300", **(env or {})}  # rich and argparse wrap at COLUMNS: keep lines whole
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def wtok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_folder(word_tokenizer_folder(tmp_path_factory.mktemp("words")))


@pytest.fixture()
def scripted_load(monkeypatch, wtok):
    """``minillm.load`` returns the scripted model (context 4,096); the names it was asked for are recorded."""
    asked: list = []

    def load(name=None, **kwargs):
        asked.append(name)
        return scripted_model(wtok, [], context=4096)

    monkeypatch.setattr(minillm, "load", load)
    monkeypatch.setenv("COLUMNS", "1000")  # rich's console width: a line of the document stays one line
    return asked


# --- 1. the serve extra ------------------------------------------------------------------------
@pytest.mark.parametrize(("command", "module"), [("serve", "fastapi"), ("serve", "uvicorn"),
                                                 ("serve", "prometheus_client"), ("bench", "httpx")])
def test_a_missing_serve_package_names_the_extra_to_install(monkeypatch, capsys, command, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ModuleNotFoundError
    monkeypatch.setenv("COLUMNS", "300")
    assert main([command]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: MissingExtraError: `minillm {command}` needs the {module} package, which the serve extra "
                   f'installs: pip install "minillm-edu[serve]" (in a source checkout: pip install -e ".[serve]").\n')


# --- 2. a closed port, a busy port ---------------------------------------------------------------
def test_bench_against_a_closed_port_is_one_line_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    proc = run_cli("bench", "--url", url, "--requests", "1", "--concurrency", "1")
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: no server answers at {url} (")
    assert lines[0].endswith("); start one (`minillm serve`) or pass its address with --url")
    assert proc.stdout == ""


def test_serve_on_a_port_in_use_says_so_before_the_banner():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_cli("serve", "--port", str(port), "--threads", "1", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == (f"error: port {port} on 127.0.0.1 is already in use (another server, or an earlier "
                           "minillm serve still running); stop it, or pass another port with --port\n")
    assert "minillm serve:" not in proc.stdout and "http://" not in proc.stdout  # no banner announced a URL


# --- 3. the context window's sentence ----------------------------------------------------------
def test_the_context_error_names_max_seq_len_in_the_library(wtok):
    model = scripted_model(wtok, [], context=4096)
    with pytest.raises(ContextWindowExceeded) as err:
        minillm.generate(model, " ".join(["w"] * 39), max_seq_len=32)
    assert str(err.value) == ("prompt is 40 tokens but the KV cache holds 32 positions, which leaves no room for a new "
                              "token; shorten the prompt to at most 31 tokens, or pass a larger max_seq_len (the model "
                              "holds 4,096).")
    small = scripted_model(wtok, [], context=32)
    with pytest.raises(ContextWindowExceeded) as err:
        minillm.generate(small, " ".join(["w"] * 39))
    assert str(err.value) == ("prompt is 40 tokens but the model holds 32 positions, which leaves no room for a new "
                              "token; shorten the prompt to at most 31 tokens.")


def test_the_context_error_names_the_flag_on_the_command_line(scripted_load, capsys):
    assert main(["run", " ".join(["w"] * 39), "--max-seq-len", "32", "-v", "quiet"]) == 2
    assert capsys.readouterr().err == (
        "error: ContextWindowExceeded: prompt is 40 tokens but the KV cache holds 32 positions, which leaves no room "
        "for a new token; shorten the prompt to at most 31 tokens, or pass a larger --max-seq-len (the model holds "
        "4,096).\n")
    assert main(["run", "w w", "--max-seq-len", "9000", "-v", "quiet"]) == 2
    assert capsys.readouterr().err == (
        "error: KVCacheFullError: --max-seq-len 9,000 is longer than the model's context of 4,096 positions; pass "
        "--max-seq-len 4,096 or less.\n")


# --- 4. chat on a base model: refused before any download ---------------------------------------
def test_chat_on_a_base_model_is_refused_before_any_download(monkeypatch, tmp_path, capsys, connections):
    from minillm.sources import hub

    def forbidden(*a, **k):
        raise AssertionError("chat on a base model must not fetch, convert or load anything")

    monkeypatch.delenv("MINILLM_MANIFEST", raising=False)
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "300")
    for name in ("resolve_model", "resolve_gguf", "_pip_download", "_fetch_hub", "_fetch_offline"):
        monkeypatch.setattr(hub, name, forbidden)
    monkeypatch.setattr(minillm, "load", forbidden)
    assert main(["chat", "-m", "gemma3-270m", "What is the capital of France?"]) == 2
    assert capsys.readouterr().err == (
        "error: ChatTemplateError: gemma3-270m has no chat template (a base model: it continues text, it does not "
        'answer messages); use `minillm run -m gemma3-270m "..."` to complete a prompt instead.\n')
    assert connections == [] and not (tmp_path / "cache").exists()


def test_the_manifest_says_which_models_have_a_chat_template(monkeypatch, tmp_path):
    from minillm.sources.manifest import load_manifest

    monkeypatch.delenv("MINILLM_MANIFEST", raising=False)
    entries = load_manifest()
    assert {n: e.chat_template for n, e in entries.items()} == {"smollm2-135m-instruct": True, "gemma3-270m": False}
    bad = tmp_path / "m.toml"
    bad.write_text('[models.x]\nfamily = "llama"\nlicense = "mit"\nchat_template = "no"\n'
                   '[models.x.hub]\nrepo = "a/b"\nfiles = ["config.json"]\n')
    with pytest.raises(ManifestError, match=r"models\.x\.chat_template must be bool, got 'no'"):
        load_manifest(bad)


# --- 5. an attached document is printed once -----------------------------------------------------
def test_chat_file_prints_the_document_once_at_the_default_verbosity(scripted_load, capsys):
    doc = ROOT / "examples" / "incident.txt"
    assert main(["chat", "--file", str(doc), "Summarize this.", "-n", "2", "--no-warmup"]) == 0
    out = capsys.readouterr().out
    lines = [line.strip() for line in doc.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(lines) >= 5
    assert {line: out.count(line) for line in lines} == {line: 1 for line in lines}
    assert f"[the user message above, {len(doc.read_text().strip()) + len(chr(10) * 2 + 'Summarize this.'):,} " \
           "characters; -v full shows it here]" in out
    assert main(["chat", "--file", str(doc), "Summarize this.", "-n", "2", "--no-warmup", "-v", "full"]) == 0
    full = capsys.readouterr().out
    assert all(full.count(line) == 2 for line in lines)  # full: in the messages and in the text the model reads


# --- 6. --version, bench --help ------------------------------------------------------------------
def test_version_prints_the_distributions_version():
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout == f"minillm {PYPROJECT['project']['version']}\n" == f"minillm {minillm.__version__}\n"


def test_bench_help_shows_every_default():
    proc = run_cli("bench", "--help")
    assert proc.returncode == 0
    for default in ("http://127.0.0.1:8000", "smollm2-135m-instruct", "1,2,4,8", "16", "64", "32", "300.0",
                    "bench-results/bench-<time>.json"):
        assert f"(default: {default})" in proc.stdout, default


# --- 7. minillm cache ------------------------------------------------------------------------------
def fake_cache(root: Path) -> None:
    """Two models as hub.py lays them out: one whole with its GGUF (3 MiB), one interrupted (1 MiB)."""
    whole = root / "models" / "tiny-a"
    whole.mkdir(parents=True)
    (whole / "config.json").write_bytes(b"{}" * (1 << 19))  # 1 MiB
    (whole / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    (whole / ".complete").write_text(json.dumps({"files": {"config.json": 1 << 20, "model.safetensors": 1 << 20}}))
    (root / "models" / "tiny-a.lock").write_text("")
    gguf = root / "gguf" / "tiny-a"
    gguf.mkdir(parents=True)
    (gguf / "tiny-a.Q4_1.gguf").write_bytes(b"\0" * (1 << 20))
    left = root / "models" / ".tmp-tiny-b.123.abcd0123"
    left.mkdir()
    (left / "part").write_bytes(b"\0" * (1 << 20))
    (root / "calibration.json").write_text("{}")


def test_cache_lists_models_with_their_sizes_and_removes_one(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "300")
    fake_cache(tmp_path)
    from minillm.sources.cache import cached_models

    marker = len((tmp_path / "models" / "tiny-a" / ".complete").read_bytes())
    got = {m.name: (m.bytes, m.complete, m.gguf) for m in cached_models()}
    assert got == {"tiny-a": (3 * (1 << 20) + marker, True, True), "tiny-b": (1 << 20, False, False)}
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert f"minillm's cache: {tmp_path}" in out
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]] for line in out.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}
    assert rows == {"tiny-a": ["3.0", "complete + GGUF"], "tiny-b": ["1.0", "incomplete"]}
    assert "2 models, 4.0 MiB; `minillm cache rm NAME` removes one" in out

    assert main(["cache", "rm", "tiny-a"]) == 0
    assert capsys.readouterr().out.startswith("removed tiny-a: 3.0 MiB freed")
    assert not (tmp_path / "models" / "tiny-a").exists() and not (tmp_path / "gguf" / "tiny-a").exists()
    assert (tmp_path / "calibration.json").exists() and [m.name for m in cached_models()] == ["tiny-b"]


def test_cache_rm_of_a_name_not_cached_removes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "300")
    fake_cache(tmp_path)
    assert main(["cache", "rm", "tiny-b", "smollm"]) == 2
    assert capsys.readouterr().err == (f"error: ModelNotFoundError: the cache at {tmp_path} holds no model 'smollm' "
                                       "(it holds tiny-a, tiny-b); `minillm cache` lists it\n")
    assert (tmp_path / "models" / ".tmp-tiny-b.123.abcd0123").exists()  # a typo removed nothing
    assert main(["cache", "rm", "../models"]) == 2


def test_an_empty_cache_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "none"))
    assert main(["cache"]) == 0
    assert capsys.readouterr().out == f"the cache at {tmp_path / 'none'} holds no model\n"


# --- 9. the distribution's name ----------------------------------------------------------------------
def test_the_distribution_is_not_pypis_other_minillm_and_the_hints_name_it():
    assert DISTRIBUTION == PYPROJECT["project"]["name"] == "minillm-edu"  # `minillm` on PyPI is another project
    assert PYPROJECT["project"]["scripts"] == {"minillm": "minillm.cli:main"}  # the command keeps its name
