"""The lessons as executed: the copies a test run keeps, and what a book build executes itself.

The test run executes every lesson (nbmake; pytest runs ``notebooks/`` first). The test suite's plugin
(``tests/support/kept_lessons.py``) hands each executed notebook to :func:`keep`, which writes it to
``build/lessons/<lesson>.ipynb`` with a record of that execution in its metadata (:data:`RECORD`):

    {"lesson": "01_lifecycle", "source_sha256": "...", "status": "passed" | "failed", "error": None | "...",
     "executed_by": "the test run (pytest, nbmake)" | "minillm book", "run": "<one id per run>",
     "finished": "2026-12-05T14:03:12+00:00", "seconds": 48.1, "machine": {"cpu": ..., "blas": [...], ...}}

A book build reads those copies (:func:`gather`): a copy of today's source (same sha256) is used as it
is, so one CI run executes each lesson once; a lesson with no copy, or a copy of an older source, is
executed here with nbclient (as nbmake does: the notebook's kernel and per-cell timeout, cwd
``notebooks/``) and kept the same way, which is the book's cache. A copy whose run failed stops the
build, naming the lesson: the book never publishes a lesson's older outputs in place of a failure.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from minillm.errors import BookError, install_command

#: The notebook metadata key that records how a kept copy was executed.
RECORD = "minillm_book"
#: Where a checkout keeps the executed copies (untracked: ``build/`` is in .gitignore).
KEPT = Path("build") / "lessons"
BY_TESTS = "the test run (pytest, nbmake)"
BY_BOOK = "minillm book"


def new_run() -> str:
    """A fresh id for one run (a pytest session, one ``minillm book``): which copies it executed."""
    return uuid.uuid4().hex[:12]


def source_sha256(source: Path) -> str:
    """The sha256 of a lesson's file as committed (hex): a kept copy of another source is stale."""
    return hashlib.sha256(source.read_bytes()).hexdigest()


def this_machine() -> dict:
    """What is executing the lessons: CPU model and cores, NumPy, and each BLAS library threadpoolctl
    finds with the kernel it runs and its threads (``[{internal_api, version, architecture, num_threads}]``)."""
    from threadpoolctl import threadpool_info

    from minillm.observe.calibrate import fingerprint

    fp = fingerprint()
    blas = [
        {k: info.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
        for info in threadpool_info()
        if info.get("user_api") == "blas"
    ]
    return {"cpu": fp["cpu"], "cores": fp["cores"], "numpy": fp["numpy"], "blas": blas}


def keep(
    source: Path,
    nb,
    *,
    error: str | None,
    executed_by: str,
    run: str,
    seconds: float,
    folder: Path,
) -> Path:
    """Write the executed notebook ``nb`` (an ``nbformat.NotebookNode``) of lesson ``source`` to
    ``folder/<lesson>.ipynb`` with its :data:`RECORD`; return the path.

    ``error`` is ``None`` for a lesson that ran to its end, else the one-line summary of what failed
    (the copy is then kept as ``failed`` and stops any book built from it). ``seconds``: wall time of
    the execution. The file is written under a temporary name and renamed, so a reader never sees half.
    """
    import nbformat

    nb.metadata[RECORD] = {
        "lesson": source.stem,
        "source_sha256": source_sha256(source),
        "status": "passed" if error is None else "failed",
        "error": error,
        "executed_by": executed_by,
        "run": run,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "machine": this_machine(),
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{source.stem}.ipynb"
    partial = folder / f".{source.stem}.{os.getpid()}.partial"
    nbformat.write(nb, str(partial))
    os.replace(partial, path)
    return path


def record_of(copy: Path) -> dict | None:
    """The :data:`RECORD` of a kept copy, or ``None`` when there is none (no file, unreadable, no record)."""
    import nbformat

    try:
        return dict(nbformat.read(str(copy), as_version=4).metadata[RECORD])
    except (OSError, ValueError, KeyError):
        return None


def execute(source: Path, folder: Path, run: str) -> dict:
    """Execute lesson ``source`` with nbclient (its own kernel and per-cell timeout, cwd its folder),
    keep the result in ``folder`` (:func:`keep`) and return its record; a failing cell, a cell past its
    timeout and a kernel that died are recorded as the lesson's failure, not raised."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(str(source), as_version=4)
    timeout = nb.metadata.get("execution", {}).get("timeout", 300)
    error, start = None, time.monotonic()
    try:
        NotebookClient(nb, timeout=timeout, record_timing=True).execute(cwd=str(source.parent))
    except CellExecutionError as exc:
        error = f"{exc.ename}: {exc.evalue}"
    except (CellTimeoutError, DeadKernelError) as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    keep(source, nb, error=error, executed_by=BY_BOOK, run=run, seconds=time.monotonic() - start, folder=folder)
    return record_of(folder / f"{source.stem}.ipynb")


@dataclass(frozen=True)
class Lesson:
    """One lesson as the book publishes it: its source, its executed copy and that copy's record."""

    name: str  # "04_prefill_vs_decode"
    source: Path
    copy: Path
    record: dict


def lesson_sources(notebooks: Path, names: list[str] | None = None) -> list[Path]:
    """The lessons in ``notebooks`` in course order (``NN_name.ipynb``), or the ``names`` among them (in course
    order too).

    Raises:
        BookError: a name that is no lesson there (the message lists the lessons).
    """
    found = sorted(p for p in notebooks.glob("[0-9][0-9]_*.ipynb"))
    if names is None:
        return found
    by_name = {p.stem: p for p in found}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise BookError(f"no lesson {', '.join(unknown)} in {notebooks}; the lessons are: {', '.join(by_name)}")
    return [by_name[n] for n in sorted(set(names))]


def _failure(name: str, record: dict) -> str:
    return f"{name} (failed in {record['executed_by']}, run {record['run']}, {record['finished']}: {record['error']})"


def gather(
    notebooks: Path,
    folder: Path,
    names: list[str] | None = None,
    *,
    execute_missing: bool = True,
    rerun: bool = False,
    on_execute: Callable[[Path], None] | None = None,
) -> list[Lesson]:
    """The executed copy of each lesson (all in ``notebooks``, or ``names``), in course order.

    A copy in ``folder`` of the lesson's current source is used as kept. A lesson without one (or every
    lesson, with ``rerun``) is executed here when ``execute_missing`` (``on_execute(source)`` is told
    first) and kept in ``folder`` for the next build.

    Raises:
        BookError: a kept or fresh copy failed (the build stops before executing anything more when a
            kept copy failed), or a copy is missing and ``execute_missing`` is off; the message names
            each lesson and what failed.
    """
    sources = lesson_sources(notebooks, names)
    copies = {src: folder / f"{src.stem}.ipynb" for src in sources}
    records = {src: record_of(copy) for src, copy in copies.items()}
    fresh = {
        src: rec for src, rec in records.items() if not rerun and rec and rec["source_sha256"] == source_sha256(src)
    }
    failed = [_failure(src.stem, rec) for src, rec in fresh.items() if rec["status"] != "passed"]
    if failed:
        raise BookError(_stop_message(failed))
    lacking = [src for src in sources if src not in fresh]
    if lacking and not execute_missing:
        raise BookError(
            f"no executed copy of today's {', '.join(s.stem for s in lacking)} in {folder}: run the lessons "
            "(python -m pytest notebooks) or let `minillm book` execute them"
        )
    run = new_run()
    for src in lacking:
        if on_execute is not None:
            on_execute(src)
        fresh[src] = execute(src, folder, run)
    failed = [_failure(src.stem, fresh[src]) for src in lacking if fresh[src]["status"] != "passed"]
    if failed:
        raise BookError(_stop_message(failed))
    return [Lesson(src.stem, src, copies[src], fresh[src]) for src in sources]


def _stop_message(failed: list[str]) -> str:
    missing = any("ModuleNotFoundError" in f for f in failed)  # a lesson's own packages: the lessons extra
    return (
        f"the book is not built: {len(failed)} lesson{'s' if len(failed) > 1 else ''} failed, and the book "
        f"publishes no older outputs in their place: {'; '.join(failed)}. Fix the lesson and run it again "
        "(python -m pytest notebooks/NAME.ipynb, or minillm book --rerun)"
        + (f"; the lessons' packages come with the lessons extra: {install_command('lessons')}" if missing else "")
    )
