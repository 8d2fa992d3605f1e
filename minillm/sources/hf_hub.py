"""Source 3 of ``hub.py``: the Hugging Face hub (``huggingface_hub.snapshot_download``, pinned revision).

One quick request first tells whether the hub answers; without it (or with ``HF_HUB_OFFLINE=1``)
the local HF cache is searched. Files are hard-linked out of the HF cache (copied across file
systems) and their sha256 checked against the manifest; any failure is a note, and the caller
tries the next source.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from minillm.sources.manifest import ModelEntry
from minillm.sources.wheels import file_sha256

HUB_ETAG_TIMEOUT = 5.0  # seconds; fail fast when the hub is unreachable, then try the next source


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


def hub_snapshot(src, files: list[str], progress: bool) -> tuple[Path | None, bool, str]:
    """``snapshot_download`` of ``files`` of the manifest's hub source ``src`` (repo at its
    revision): ``(snapshot folder or None, local_only, why)``, ``why`` saying why only the local HF
    cache was searched, or what failed. Reads HF_HUB_OFFLINE, HF_HUB_CACHE/HF_HOME, HF_ENDPOINT now
    (huggingface_hub reads them once, at import, so a late setenv would not count)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

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
            HfApi(endpoint=endpoint).repo_info(src.repo, revision=src.revision, timeout=HUB_ETAG_TIMEOUT)
        except _hub_errors() as exc:
            local_only, why = True, f"hub unreachable: {_first_line(exc)}"
    bars_were_off = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        folder = snapshot_download(
            src.repo,
            revision=src.revision,
            allow_patterns=list(files),
            etag_timeout=HUB_ETAG_TIMEOUT,
            local_files_only=local_only,
            cache_dir=cache or None,
            endpoint=endpoint,
        )
        return Path(folder), local_only, why
    except _hub_errors() as exc:
        return None, local_only, f"{why}; no complete copy in the local HF cache" if local_only else _first_line(exc)
    finally:
        if not progress and not bars_were_off:
            enable_progress_bars()


def fetch_hub(entry: ModelEntry, tmp: Path, progress: bool, seconds: dict, notes: list) -> str | None:
    """Fetch the hub files into ``tmp``; return a one-line origin, or None (with a note) to fall through."""
    hub, t = entry.hub, time.perf_counter()
    where = f"{hub.repo}@{hub.revision[:12]}"
    snapshot, local_only, why = hub_snapshot(hub, list(hub.files), progress)
    if snapshot is None:
        notes.append(f"hub {where} unavailable ({why})")
        return None
    if local_only:
        notes.append(f"hub {where}: {why}; using the local HF cache")
    # Offline, snapshot_download returns a cached snapshot folder even when it lacks files.
    missing = [f for f in hub.files if not (snapshot / f).is_file()]
    if missing:
        notes.append(f"hub {where}: the snapshot {snapshot} lacks {', '.join(missing)}")
        return None
    for f in hub.files:
        link_or_copy(snapshot / f, tmp / f)
    seconds["fetch"] = time.perf_counter() - t
    t = time.perf_counter()
    for f, want in hub.sha256.items():
        got = file_sha256(tmp / f)
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


def link_or_copy(src: Path, dst: Path) -> None:
    # HF snapshots hold symlinks into blobs/; a hard link to the blob shares its bytes, and keeps
    # them if the HF cache is cleaned. Across file systems, copy.
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src.resolve(), dst)
    except OSError:
        shutil.copyfile(src, dst)
