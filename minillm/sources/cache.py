"""What minillm's cache holds, and taking a model out of it (``minillm cache``).

The layout ``hub.py`` writes under :func:`~minillm.sources.hub.cache_root`::

    models/<name>/            a model folder (config.json, model.safetensors, tokenizer.json, ...);
                              its .complete marker, written last, lists every file and its size
    models/<name>.lock        the file lock of its fetch
    models/.tmp-<name>.*      what an interrupted fetch left (cleaned up by the next fetch)
    gguf/<name>/<file>.gguf   the packed GGUF, kept for weight_dtype="gguf"
    calibration.json          this machine's measured rates (``minillm calibrate``)

A model's size here is the bytes of its folders: the converted model, its GGUF, any leftovers.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from minillm.errors import MiniLLMError, ModelNotFoundError
from minillm.sources import hub

MIB = 1 << 20
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")  # a cache folder name (manifest names are the same shape)


@dataclass(frozen=True)
class CachedModel:
    """One model in the cache: its folders and their total size."""

    name: str
    folders: tuple[Path, ...]  # models/<name>, gguf/<name>, leftovers: what `remove_cached` deletes
    bytes: int  # every file under those folders
    complete: bool  # models/<name> is whole (its marker lists every file at its size)
    gguf: bool  # gguf/<name> holds a packed GGUF

    @property
    def mib(self) -> float:
        return self.bytes / MIB


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _folders_of(root: Path) -> dict[str, list[Path]]:
    """``{name: [folders]}`` of every model the cache holds anything of, by name."""
    found: dict[str, list[Path]] = {}
    for sub in ("models", "gguf"):
        if not (root / sub).is_dir():
            continue
        for path in sorted((root / sub).iterdir()):
            if not path.is_dir():
                continue  # lock files
            name = path.name
            if name.startswith(".tmp-") and sub == "models":  # .tmp-<name>.<pid>.<hex>[.download]
                name = name[len(".tmp-") :].split(".")[0]
            if _NAME.match(name):
                found.setdefault(name, []).append(path)
    return found


def cached_models(root: str | os.PathLike | None = None) -> list[CachedModel]:
    """Every model in the cache at ``root`` (default :func:`~minillm.sources.hub.cache_root`), by name.

    Returns:
        one :class:`CachedModel` per name, sizes in bytes; an empty list when the cache holds none.
    """
    root = Path(root) if root is not None else hub.cache_root()
    out = []
    for name, folders in sorted(_folders_of(root).items()):
        model_folder = root / "models" / name
        out.append(
            CachedModel(
                name=name,
                folders=tuple(folders),
                bytes=sum(_folder_bytes(f) for f in folders),
                complete=model_folder.is_dir() and hub._cached(model_folder) is not None,
                gguf=any(f.parent.name == "gguf" and any(f.glob("*.gguf")) for f in folders),
            )
        )
    return out


def remove_cached(name: str, root: str | os.PathLike | None = None) -> CachedModel:
    """Delete every folder of model ``name`` from the cache (the next use fetches it again).

    Holds the model's fetch lock while deleting, so a fetch in progress is never cut under its feet.

    Returns:
        what was removed (its folders and bytes).

    Raises:
        ModelNotFoundError: the cache holds nothing called ``name`` (the message lists what it holds).
        MiniLLMError: another process is fetching it right now.
    """
    root = Path(root) if root is not None else hub.cache_root()
    key = name.strip().lower()
    held = {m.name: m for m in cached_models(root)}
    if key not in held:
        listing = ", ".join(held) or "nothing"
        raise ModelNotFoundError(
            f"the cache at {root} holds no model {name!r} (it holds {listing}); `minillm cache` lists it"
        )
    model = held[key]
    locks = [FileLock(str(root / sub / f"{key}.lock")) for sub in ("models", "gguf") if (root / sub).is_dir()]
    try:
        for lock in locks:
            lock.acquire(timeout=0.1)
    except Timeout:
        for lock in locks:
            lock.release()  # the ones taken (a lock not held releases as a no-op)
        raise MiniLLMError(
            f"another process is fetching {key} into {root} right now; remove it once that is done"
        ) from None
    try:
        for folder in model.folders:
            shutil.rmtree(folder)
    finally:
        for lock in locks:
            lock.release()
    return model
