"""The architecture as a checked contract: import-linter's layers and no cycles (pyproject.toml), and
ruff's style, run on the package. A forbidden import planted in a copy of the package must break them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                "sys.exit(lint_imports_command())"]


def lint_imports(top: Path) -> subprocess.CompletedProcess:
    """Run import-linter on the package under ``top`` (its own pyproject.toml, its own copy first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(top)}
    return subprocess.run([*LINT_IMPORTS, "--config", str(top / "pyproject.toml"), "--no-cache"], cwd=top, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 kept, 0 broken" in run.stdout


def planted(tmp_path: Path, module: str, source: str) -> Path:
    """A copy of the package with one extra module (``minillm/<module>.py``)."""
    shutil.copytree(ROOT / "minillm", tmp_path / "minillm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "minillm" / f"{module}.py").write_text(source)
    return tmp_path


def test_the_math_importing_the_trace_breaks_the_layers(tmp_path):
    top = planted(tmp_path, "model/leak", "from minillm.observe import events  # the math may not know the trace\n")
    run = lint_imports(top)
    assert run.returncode != 0
    assert "minillm.model.leak -> minillm.observe.events" in run.stdout


def test_the_runtime_importing_the_shell_breaks_the_layers(tmp_path):
    top = planted(tmp_path, "runtime/leak", "import minillm.cli\n")
    run = lint_imports(top)
    assert run.returncode != 0 and "minillm.runtime.leak -> minillm.cli" in run.stdout


def test_a_cycle_between_siblings_breaks_the_contract(tmp_path):
    top = planted(tmp_path, "text/loop", "import minillm.model.config\n")
    (top / "minillm" / "model" / "loop.py").write_text("import minillm.text.tokenizer\n")
    run = lint_imports(top)
    assert run.returncode != 0
    assert "No import cycles between sibling modules BROKEN" in run.stdout


def test_ruff_is_clean_on_the_package_and_benchmarks():
    for args in (["check"], ["format", "--check"]):
        run = subprocess.run([sys.executable, "-m", "ruff", *args, "minillm", "benchmarks"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
