"""A student's units, read from a folder (the exercises) and plugged into the forward at the seam.

A folder made by ``minillm exercises start DIR`` holds one file per unit, ``DIR/<unit>.py``, defining
the textbook's function or class under its own name (``causal_mask.py`` defines ``causal_mask``;
``apply_rope.py`` defines ``apply_rope`` and ``rotate_half``). A unit is *started* once its file's
definitions are more than the stub's ``raise NotImplementedError`` (read from the source, never by
calling it). :func:`unit_kernels` turns the started units the forward is made of
(``model.kernels.MODEL_UNITS``) into a :class:`~minillm.model.kernels.UnitKernels`: the one
documented mechanism by which a student's code runs inside the real model (``minillm.load(name,
units=DIR)``, ``minillm run --units DIR``). No module is patched: the model holds those kernels.

The student's code cannot change the loaded model: every array it is handed is a read-only view
(:func:`read_only`), so writing into a weight raises ``ValueError: assignment destination is read-only``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

from minillm.errors import InvalidRequestError, MiniLLMError
from minillm.model.kernels import MODEL_UNITS, UnitKernels
from minillm.model.kv_cache import KVCache


class UnitsError(MiniLLMError):
    """A units folder is missing or unreadable, or a unit's file cannot be imported."""


#: unit -> the names its file must define (the first is the unit's own name).
DEFINES = {"apply_rope": ("apply_rope", "rotate_half")}


def names_of(unit: str) -> tuple[str, ...]:
    """The names ``<unit>.py`` defines: ``(unit,)``, or the unit and its helpers (:data:`DEFINES`)."""
    return DEFINES.get(unit, (unit,))


def check_folder(folder: str | os.PathLike) -> Path:
    """``folder`` as a Path, after checking it is a readable directory.

    Raises:
        UnitsError: it does not exist, is a file, or cannot be listed; the message says how to make one.
    """
    path = Path(folder).expanduser()
    make = f"make one with: minillm exercises start {folder}"
    if not path.exists():
        raise UnitsError(f"units folder {str(path)!r} does not exist; {make}")
    if not path.is_dir():
        raise UnitsError(f"units folder {str(path)!r} is a file, not a folder; {make}")
    try:
        os.listdir(path)
    except OSError as e:
        raise UnitsError(f"units folder {str(path)!r} cannot be read ({e.strerror}); check its permissions.") from e
    return path


def _is_stub_body(body: list[ast.stmt]) -> bool:
    """A body that is (after an optional docstring) one ``raise NotImplementedError...``."""
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def is_started(source: str, names: tuple[str, ...]) -> bool:
    """Whether a unit file's ``source`` implements any of ``names``: a function whose body is more than
    the stub's ``raise NotImplementedError``, or a class with one such method. A file that does not
    parse counts as started (grading then says why it cannot be imported)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            if not _is_stub_body(node.body):
                return True
        if isinstance(node, ast.ClassDef) and node.name in names:
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if any(not _is_stub_body(m.body) for m in methods):
                return True
    return False


def unit_path(folder: str | os.PathLike, unit: str) -> Path:
    """``folder/<unit>.py``."""
    return Path(folder) / f"{unit}.py"


def started_units(folder: str | os.PathLike, units=MODEL_UNITS) -> list[str]:
    """The ``units`` whose file in ``folder`` exists and is started (:func:`is_started`), in order.

    Raises:
        UnitsError: as :func:`check_folder`; a unit file that cannot be read.
    """
    path = check_folder(folder)
    found = []
    for unit in units:
        file = unit_path(path, unit)
        if not file.is_file():
            continue
        try:
            source = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UnitsError(f"{file} cannot be read ({e}); save it as UTF-8 text.") from e
        if is_started(source, names_of(unit)):
            found.append(unit)
    return found


def import_unit(folder: str | os.PathLike, unit: str) -> ModuleType:
    """Import ``folder/<unit>.py`` as a fresh module (never cached in ``sys.modules``, so an edited
    file is read again) and return it. The folder is on ``sys.path`` while it runs, so one unit file
    may import another (``from softmax import softmax``).

    Raises:
        UnitsError: the file is missing, or it does not define the unit's names. Errors raised by the
            student's code at import (a SyntaxError, an ImportError...) propagate unchanged: the
            grader shows them trimmed to the student's file.
    """
    file = unit_path(check_folder(folder), unit)
    if not file.is_file():
        raise UnitsError(f"{file} is missing; minillm exercises start {folder} writes its stub.")
    spec = importlib.util.spec_from_file_location(f"minillm_student_{unit}", file)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(file.parent))
    missing = [n for n in names_of(unit) if not hasattr(module, n)]
    if missing:
        raise UnitsError(f"{file} does not define {', '.join(missing)}; keep the stub's names and signatures.")
    return module


def _frozen(value):
    """A read-only view of an array (other values as they are)."""
    if isinstance(value, np.ndarray):
        view = value.view()
        view.flags.writeable = False
        return view
    return value


def read_only(fn):
    """``fn`` handed read-only views of every array argument: a student's unit cannot write into the
    model's weights, the RoPE tables or the cache it is given."""

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        kwargs.pop("out", None)  # softmax's out=, a speed-up: the caller uses what it returns
        return fn(*(_frozen(a) for a in args), **{k: _frozen(v) for k, v in kwargs.items()})

    return guarded


def student_cache_class(student: type) -> type[KVCache]:
    """A :class:`KVCache` whose storage is the student's class ``student``
    (``student(num_layers, num_kv_heads, head_dim, max_seq_len)`` with ``write(layer, k, v) -> (keys,
    values)``, ``read(layer, end)``, ``advance(seq)``, ``truncate(length)`` and ``length``); the
    textbook's bookkeeping (room checks, sizes in bytes, compatibility) stays around it. float32 only."""

    class StudentKVCache(KVCache):
        def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int, dtype: str = "float32"):
            if dtype != "float32":
                raise InvalidRequestError(f"the student's KVCache holds float32 only; got kv_dtype={dtype!r}.")
            if max_seq_len <= 0:
                raise InvalidRequestError(f"KVCache max_seq_len must be positive, got {max_seq_len}.")
            self.dtype, self.num_layers, self.num_kv_heads = dtype, num_layers, num_kv_heads
            self.head_dim, self.max_seq_len = head_dim, max_seq_len
            self.inner = student(num_layers, num_kv_heads, head_dim, max_seq_len)

        length = property(lambda self: int(self.inner.length))

        @property
        def nbytes(self) -> int:
            return 2 * self.num_layers * self.num_kv_heads * self.max_seq_len * self.head_dim * 4

        def write(self, layer, k, v):
            keys, values = self.inner.write(layer, _frozen(k), _frozen(v))
            return np.asarray(keys, dtype=np.float32), np.asarray(values, dtype=np.float32)

        def read(self, layer, end):
            keys, values = self.inner.read(layer, end)
            return np.asarray(keys, dtype=np.float32), np.asarray(values, dtype=np.float32)

        def advance(self, seq):
            self.inner.advance(seq)

        def truncate(self, length):
            if not 0 <= length <= self.length:
                raise InvalidRequestError(f"cannot truncate a cache of length {self.length} to {length}.")
            self.inner.truncate(length)

        def reset(self):
            self.inner.truncate(0)

        def free(self):
            self.max_seq_len = 0
            self.inner = student(self.num_layers, self.num_kv_heads, self.head_dim, 1)

        def __repr__(self):
            return f"StudentKVCache({type(self.inner).__name__}, length={self.length}/{self.max_seq_len})"

    StudentKVCache.__qualname__ = StudentKVCache.__name__ = f"StudentKVCache[{student.__module__}]"
    return StudentKVCache


def unit_kernels(folder: str | os.PathLike, units=None) -> UnitKernels:
    """The plain kernels with ``folder``'s started model units in place of the textbook's.

    ``units``: which of ``MODEL_UNITS`` to take (None: every started one). The trace's load section
    names them (``UnitKernels.name``) and the folder (``UnitKernels.source``).

    Raises:
        UnitsError: a missing or unreadable folder, a unit in ``units`` that is not a model unit or not
            started, a file that does not define its names.
    """
    path = check_folder(folder)
    chosen = started_units(path) if units is None else list(units)
    unknown = [u for u in chosen if u not in MODEL_UNITS]
    if unknown:
        raise UnitsError(f"{', '.join(unknown)}: not units of the forward; those are {', '.join(MODEL_UNITS)}.")
    not_started = [u for u in chosen if u not in started_units(path, chosen)]
    if not_started:
        raise UnitsError(f"{', '.join(not_started)} in {path} still raise NotImplementedError; write them first.")
    replacements = {}
    for unit in chosen:
        obj = getattr(import_unit(path, unit), unit)
        replacements[unit] = student_cache_class(obj) if unit == "KVCache" else read_only(obj)
    return UnitKernels(replacements, source=str(path))
