"""Grading: each unit in a process of its own, stopped after a stated time, with a verdict.

For each unit named: *not started* (its file is missing or still the stub), else the unit cases
against the textbook (``cases.py``), then the unit at work (``inside.py``: inside SmolLM2, or in
closed form). Each unit runs in a forked child process, so a unit that hangs is stopped after
``timeout`` seconds and the others are still graded, a unit that crashes its interpreter fails alone,
and nothing a student's code does reaches the loaded model (the child has a copy; the arrays it is
handed are read-only as well). SmolLM2 is loaded once, before the children fork, so each child
shares its pages. A traceback is trimmed to the student's own file.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

from minillm.errors import MissingExtraError, install_command
from minillm.exercises.cases import CHECKS, Context
from minillm.exercises.compare import Failed
from minillm.exercises.inside import ModelReference, closed_form
from minillm.exercises.units import UNITS, Unit, unit_named
from minillm.runtime.units import check_folder, import_unit, is_started, unit_path

#: Seconds a unit may take (both stages) before it is stopped and failed.
DEFAULT_TIMEOUT = 90.0
#: The model the in-model stage runs.
MODEL = "smollm2-135m-instruct"


@dataclass
class Verdict:
    """One unit's grade.

    status: ``"passed"``, ``"failed"`` or ``"not started"``; stage: where it stopped (``"unit cases"``,
    ``"in the model"``, ``"closed form"``, ``"import"``, ``"time"``) or where it got to; case, message,
    hint: what failed (:class:`~minillm.exercises.compare.Failed`); traceback: the student's frames of
    an exception their code raised; seconds: wall time.
    """

    unit: str
    status: str
    lesson: str
    stage: str = ""
    case: str | None = None
    message: str = ""
    hint: str | None = None
    traceback: str | None = None
    seconds: float = 0.0
    seed: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Grading:
    """What one run of the grader needs: the seed, how many generated cases, the per-unit time limit,
    and the model reference (loaded once, lazily, in the parent)."""

    seed: int = 0
    examples: int = 25
    timeout: float = DEFAULT_TIMEOUT
    model_name: str = MODEL
    _reference: ModelReference | None = field(default=None, repr=False)
    _tokenizer: object = field(default=None, repr=False)

    def reference(self) -> ModelReference:
        if self._reference is None:
            import minillm

            model = minillm.load(self.model_name, kernels="plain", progress=False, warmup=False)
            self._reference = ModelReference(model)
            self._tokenizer = model.tokenizer
        return self._reference

    def tokenizer(self):
        if self._tokenizer is None:
            from minillm.sources.hub import resolve_model
            from minillm.text.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_folder(resolve_model(self.model_name, progress=False).path)
        return self._tokenizer


def require_hypothesis() -> None:
    """Raise :class:`MissingExtraError` (naming the install command) unless hypothesis is installed."""
    try:
        import hypothesis  # noqa: F401
    except ImportError as e:
        raise MissingExtraError(
            f"grading needs hypothesis (the exercises extra): {install_command('exercises')}"
        ) from e


def _student_frames(exc: BaseException, files: set[str]) -> str:
    """``exc``'s traceback, only the frames in the student's ``files``, then the exception line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename) in files]
    if isinstance(exc, SyntaxError) and exc.filename and os.path.realpath(exc.filename) in files:
        return "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
    text = "".join(traceback.format_list(frames)) if frames else ""
    return (text + "".join(traceback.format_exception_only(type(exc), exc))).rstrip()


def _grade_here(unit: Unit, ns, files: set[str], grading: Grading, source: str) -> Verdict:
    """Both stages on ``ns`` (an object with the unit's names), in this process."""
    verdict = Verdict(unit=unit.name, status="failed", lesson=unit.lesson, seed=grading.seed)
    ctx = Context(seed=grading.seed, examples=grading.examples, tokenizer_factory=grading.tokenizer)
    try:
        verdict.stage = "unit cases"
        with contextlib.redirect_stdout(io.StringIO()):
            CHECKS[unit.name](ns, ctx)
            if unit.inside == "model":
                verdict.stage = "in the model"
                grading.reference().check(unit.name, getattr(ns, unit.name), source)
            elif unit.inside == "closed form":
                verdict.stage = "closed form"
                closed_form(unit.name, ns)
    except Failed as failed:
        verdict.case, verdict.message, verdict.hint = failed.case, failed.message, failed.hint
        return verdict
    except NotImplementedError as e:
        verdict.status, verdict.message = "not started", f"raises NotImplementedError ({e})"
        return verdict
    except Exception as e:  # noqa: BLE001 (the student's code may raise anything: say what and where)
        verdict.message = f"your code raised {type(e).__name__}: {e}"
        verdict.traceback = _student_frames(e, files)
        if isinstance(e, ValueError) and "read-only" in str(e):
            verdict.hint = (
                "your code writes into an array it was handed (read-only): work on a copy or return a new array"
            )
        return verdict
    verdict.status, verdict.stage = (
        "passed",
        {"model": "in the model", "closed form": "closed form"}.get(unit.inside, "unit cases"),
    )
    return verdict


def _child(unit: Unit, load, grading: Grading, source: str, conn) -> None:
    """In the forked child: import the student's unit (``load()``), grade it, send the verdict."""
    files: set[str] = set()
    try:
        ns, files = load()
    except Exception as e:  # noqa: BLE001
        v = Verdict(unit=unit.name, status="failed", lesson=unit.lesson, stage="import", seed=grading.seed)
        v.message = f"the file cannot be imported: {type(e).__name__}: {e}"
        v.traceback = _student_frames(e, {os.path.realpath(source)} | files)
        conn.send(v.as_dict())
        return
    conn.send(_grade_here(unit, ns, files, grading, source).as_dict())


def grade_unit(unit: Unit, load, grading: Grading, source: str) -> Verdict:
    """Grade one unit in a forked child, within ``grading.timeout`` seconds. ``load()`` returns the
    student's namespace and the set of their files (real paths)."""
    if unit.inside == "model":
        grading.reference()  # loaded before the fork: the child shares its pages
    if unit.name == "IncrementalDetokenizer":
        grading.tokenizer()
    start = time.perf_counter()
    fork = multiprocessing.get_context("fork")
    parent, child = fork.Pipe(duplex=False)
    process = fork.Process(target=_child, args=(unit, load, grading, source, child), daemon=True)
    process.start()
    child.close()
    try:
        if parent.poll(grading.timeout):
            try:
                verdict = Verdict(**parent.recv())
            except EOFError:
                verdict = None
        else:
            verdict = Verdict(unit=unit.name, status="failed", lesson=unit.lesson, stage="time", seed=grading.seed,
                message=f"stopped after {grading.timeout:g} s: the unit did not finish (an endless loop?)",
            )  # fmt: skip
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        parent.close()
    if verdict is None:
        verdict = Verdict(unit=unit.name, status="failed", lesson=unit.lesson, stage="crash", seed=grading.seed,
            message=f"the grading process died (exit code {process.exitcode}) while running your code",
        )  # fmt: skip
    verdict.seconds = time.perf_counter() - start
    return verdict


def _verdict(unit: Unit, grading: Grading, status: str, message: str, stage: str = "") -> Verdict:
    """A verdict given without running the unit (missing, unreadable, still the stub)."""
    return Verdict(unit=unit.name, status=status, lesson=unit.lesson, stage=stage, message=message, seed=grading.seed)


def grade_folder(folder, units: list[str] | None = None, grading: Grading | None = None) -> list[Verdict]:
    """Grade ``units`` (default: all) of a student folder.

    Raises:
        UnitsError: a missing or unreadable ``folder``.
        KeyError: an unknown unit name.
    """
    require_hypothesis()
    path = check_folder(folder)
    grading = grading or Grading()
    chosen = [unit_named(u) for u in units] if units else list(UNITS)
    verdicts = []
    for unit in chosen:
        file = unit_path(path, unit.name)
        if not file.is_file():
            verdicts.append(_verdict(unit, grading, "not started", f"{file.name} is missing"))
            continue
        try:
            started = is_started(file.read_text(encoding="utf-8"), unit.names)
        except (OSError, UnicodeDecodeError) as e:
            verdicts.append(_verdict(unit, grading, "failed", f"{file} cannot be read: {e}", stage="import"))
            continue
        if not started:
            verdicts.append(_verdict(unit, grading, "not started", "still the stub"))
            continue
        real = os.path.realpath(file)

        def load(unit=unit, real=real):
            return import_unit(path, unit.name), {real}

        verdicts.append(grade_unit(unit, load, grading, str(file)))
    return verdicts


def grade_objects(unit_name: str, objects: dict, grading: Grading | None = None) -> Verdict:
    """Grade objects defined in Python (a notebook's function or class) as ``unit_name``.

    Raises:
        KeyError: an unknown unit, or a name the unit needs that ``objects`` lacks.
    """
    require_hypothesis()
    unit = unit_named(unit_name)
    missing = [n for n in unit.names if n not in objects]
    if missing:
        raise KeyError(
            f"{unit_name} needs {', '.join(missing)} as well: pass it, e.g. check({unit_name!r}, fn, {missing[0]}=...)"
        )
    files = set()
    for obj in objects.values():
        code = getattr(obj, "__code__", None)
        if code is not None:
            files.add(os.path.realpath(code.co_filename))
    ns = SimpleNamespace(**objects)
    source = next(iter(files), "<python>")
    return grade_unit(unit, lambda: (ns, files), grading or Grading(), source)


def exit_status(verdicts: list[Verdict]) -> int:
    """0 when every verdict passed, else 1."""
    return 0 if verdicts and all(v.status == "passed" for v in verdicts) else 1


def files_of(folder) -> list[Path]:
    """The unit files a folder holds."""
    return [unit_path(folder, u.name) for u in UNITS if unit_path(folder, u.name).is_file()]
