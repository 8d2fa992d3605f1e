"""The README's and the lessons' prose name code that exists (issue 42: code moved, and a lesson that
sends a student to ``model/batch.py`` after it is gone teaches a file that is not there).

Two kinds of pointer are checked, in README.md and in every lesson's markdown cells:
- a path into the package (``minillm/runtime/plan.py``, or ``runtime/plan.py`` as the lessons write
  it): the file exists;
- a dotted reference ``subpackage.module.name`` (``kernels.products.PLAN``): the module imports and has
  the name (the same rule ``test_architecture`` applies to the package's docstrings).
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = "model|kernels|text|runtime|observe|sources|serve|deploy|cli"
#: ``minillm/model/passes.py`` or ``model/passes.py`` (a file of the package)
PACKAGE_PATH = re.compile(rf"(?<![\w/.-])((?:minillm/)?(?:{SUBPACKAGES})/[\w/]*\w\.(?:py|html))")
#: ``runtime.plan.execute`` or ``minillm.runtime.plan.execute``
REFERENCE = re.compile(rf"(?<![\w.])(?:minillm\.)?((?:{SUBPACKAGES})\.\w+)\.(\w+)")


def model_attributes() -> set[str]:
    """``model.transformer``, ``model.config``, ...: how the lessons reach into a loaded :class:`minillm.Model`."""
    import dataclasses

    import minillm

    return {f"model.{f.name}" for f in dataclasses.fields(minillm.Model)}


MODEL_ATTRIBUTES = model_attributes()


def prose_of(path: Path) -> str:
    """README.md's text, or a lesson's markdown cells joined."""
    if path.suffix == ".md":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def stale_pointers(text: str, root: Path = ROOT) -> list[str]:
    """The paths in ``text`` that name no file under ``root/minillm`` and the dotted references whose
    module lacks the name (a dotted name whose module does not import is a path of another kind)."""
    stale = []
    for m in PACKAGE_PATH.finditer(text):
        path = m.group(1) if m.group(1).startswith("minillm/") else f"minillm/{m.group(1)}"
        if not (root / path).is_file():
            stale.append(m.group(1))
    for m in REFERENCE.finditer(text):
        if m.group(1) in MODEL_ATTRIBUTES:  # ``model.transformer.forward``: a loaded model's attribute
            continue
        try:
            module = importlib.import_module(f"minillm.{m.group(1)}")
        except ModuleNotFoundError:
            continue
        if not hasattr(module, m.group(2)):
            stale.append(m.group(0))
    return stale


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "notebooks").glob("*.ipynb"))]


def test_the_readme_and_every_lesson_point_at_code_that_exists():
    assert len(documents()) >= 18  # the README and seventeen lessons at least
    stale = {path.name: found for path in documents() if (found := stale_pointers(prose_of(path)))}
    assert not stale, stale


def test_a_moved_file_and_a_missing_name_are_found():
    text = (
        "Each step is planned in ``runtime/plan.py`` (``minillm/runtime/plan.py``); the textbook's batch "
        "lived in ``model/batch.py``. ``runtime.plan.execute`` runs a plan; ``runtime.plan.run_all`` never existed; "
        "``model.transformer.forward(ids)`` is a loaded model's method."
    )
    assert stale_pointers(text) == ["model/batch.py", "runtime.plan.run_all"]
