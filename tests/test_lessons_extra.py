"""The ``lessons`` extra installs everything the lessons import (issue 32).

Every code cell of notebooks/*.ipynb is parsed (ast; IPython's ``%`` and ``!`` lines dropped), and so
is every ``benchmarks/<name>.py`` a lesson imports or runs (``-m benchmarks.<name>``), all its imports
(a function's own too: ``xllamacpp`` is imported where it is used). Each third-party module is mapped
to its distribution (``importlib.metadata.packages_distributions``) and must be required by the
``lessons`` extra or by minillm itself; a lesson that starts ``minillm serve`` needs the ``serve``
extra's packages in it too.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCAL = {"minillm", "benchmarks"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503: Jinja2 ~ jinja2, prometheus_client ~ prometheus-client


def requirements(extra: str | None) -> dict[str, Requirement]:
    listed = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return {normalized(r.name): r for r in map(Requirement, listed)}


def imported_modules(source: str, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(source)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def lesson_sources() -> dict[str, str]:
    """``{notebook name: the code of its cells}``, IPython magics and shell lines dropped."""
    out = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        code = ["".join(c["source"]) for c in cells]
        out[path.name] = "\n".join(
            "" if line.lstrip().startswith(("%", "!")) else line for cell in code for line in cell.splitlines()
        )
    return out


def test_the_lessons_extra_installs_every_module_the_lessons_import():
    lessons, base = requirements("lessons"), requirements(None)
    distributions = packages_distributions()
    needs: dict[str, set[str]] = {}  # module -> the lessons that import it
    sources = lesson_sources()
    assert len(sources) >= 12
    for name, code in sources.items():
        modules = imported_modules(code, top_level_only=False)  # a cell's imports are at its top level or in a def
        for bench in set(re.findall(r"benchmarks\.(\w+)", code)):
            modules |= imported_modules((ROOT / "benchmarks" / f"{bench}.py").read_text(), top_level_only=False)
        for module in modules - LOCAL - set(sys.stdlib_module_names):
            needs.setdefault(module, set()).add(name)
    assert {"torch", "transformers", "openai", "httpx", "prometheus_client", "xllamacpp", "matplotlib"} <= set(needs)
    unmet = {}
    for module, where in sorted(needs.items()):
        dists = {normalized(d) for d in distributions.get(module, [])}
        assert dists, f"{module} (imported by {sorted(where)}) is not installed here: which distribution is it?"
        if not dists & (set(lessons) | set(base)):
            unmet[module] = (sorted(dists), sorted(where))
    assert unmet == {}, f"add these to the lessons extra in pyproject.toml: {unmet}"


def test_a_lesson_that_starts_minillm_serve_gets_the_serve_extra():
    starts_server = [n for n, code in lesson_sources().items() if re.search(r'"minillm",\s*"serve"', code)]
    assert starts_server, "no lesson starts `minillm serve` any more: drop this test"
    assert set(requirements("serve")) <= set(requirements("lessons"))


def test_the_lessons_extra_pins_torch_exactly_and_runs_notebooks():
    lessons = requirements("lessons")
    assert str(lessons["torch"].specifier) == "==2.13.0"  # an open range pulls a multi-GB CUDA build
    assert str(lessons["xllamacpp"].specifier) == str(requirements("test")["xllamacpp"].specifier)
    assert {"nbclient", "ipykernel", "matplotlib", "transformers", "openai"} <= set(lessons)
