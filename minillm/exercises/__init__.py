"""Your turn: the exercises. A student writes the textbook's units and sees them graded, then run
inside the real model.

    minillm exercises start DIR                     # one stub per unit (refuses to overwrite your changes)
    minillm exercises check [UNIT ...] --dir DIR    # graded: unit cases, then inside SmolLM2 or in closed form
    minillm run --units DIR "The capital of France is"   # the real request on your code

From Python or Jupyter, a function defined in a notebook::

    from minillm import exercises
    exercises.check("causal_mask", my_causal_mask)  # the same verdict, shown as a rich table

``units.py`` lists the units and their lessons; ``cases.py`` the first grading (against the textbook),
``inside.py`` the second (in the model, or in closed form); ``grade.py`` runs each unit in a process of
its own, stopped after a stated time.
"""

from __future__ import annotations

import os
from pathlib import Path

from minillm.exercises.grade import DEFAULT_TIMEOUT, Grading, Verdict, exit_status, grade_folder, grade_objects
from minillm.exercises.report import Shown, as_json, show
from minillm.exercises.units import UNITS, stub_source, unit_named
from minillm.runtime.units import UnitsError, unit_path

__all__ = ["UNITS", "Grading", "Shown", "Verdict", "as_json", "check", "check_folder", "exit_status", "show", "start"]


def start(folder: str | os.PathLike) -> dict[str, list[str]]:
    """Write one stub per unit into ``folder`` (made if missing): ``{"written": [...], "kept": [...]}``.

    A file that differs from its stub (the student's work) is never overwritten: it is listed under
    ``"kept"``. Each file is written whole (a temporary file, then renamed), so none is left half-written.

    Raises:
        UnitsError: ``folder`` is a file, or cannot be made or written.
    """
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise UnitsError(f"{str(path)!r} is a file; pass a folder for the exercises.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UnitsError(f"cannot make the folder {str(path)!r} ({e.strerror}); choose another place.") from e
    done: dict[str, list[str]] = {"written": [], "kept": []}
    for unit in UNITS:
        file, text = unit_path(path, unit.name), stub_source(unit, str(folder))
        if file.exists():
            if file.read_text(encoding="utf-8", errors="replace") != text:
                done["kept"].append(file.name)
                continue
        tmp = file.with_name(f".{file.name}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, file)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise UnitsError(f"cannot write {file} ({e.strerror}); check the folder's permissions.") from e
        done["written"].append(file.name)
    return done


def check_folder(folder, units=None, *, seed: int = 0, timeout: float = DEFAULT_TIMEOUT) -> Shown:
    """Grade ``units`` (default: all) of a student ``folder``; the result shows itself as a table."""
    return Shown(grade_folder(folder, units, Grading(seed=seed, timeout=timeout)))


def check(unit: str, impl=None, /, *, seed: int = 0, timeout: float = DEFAULT_TIMEOUT, **helpers) -> Shown:
    """Grade ``impl`` (a function or class defined in Python, e.g. in a notebook) as ``unit``.

    ``helpers``: the unit's other names (``apply_rope`` needs ``rotate_half``); by default taken from
    ``impl``'s module globals (a notebook's), where the student defined them.

    Raises:
        KeyError: an unknown unit, or a helper that cannot be found.
    """
    u = unit_named(unit)
    objects = dict(helpers)
    objects[u.name] = impl
    for name in u.names:
        if name not in objects and impl is not None:
            found = getattr(impl, "__globals__", {}).get(name)
            if found is not None:
                objects[name] = found
    return Shown([grade_objects(unit, objects, Grading(seed=seed, timeout=timeout))])
