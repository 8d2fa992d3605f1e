"""The seam between the textbook and the engine room, as checked facts (issue 42).

The layers hand a forward pass arrays and held matrices only (``model/passes.py``,
``model/kernels.py``): no parameter in ``minillm/model/`` or on the engine room's public functions
says *which* projection a product is (``projection``) or whether the rows are a batch's
(``batched``); the pass knows its rows. And the engine room (``minillm/kernels/``) never imports
``minillm/model/transformer.py``: it is handed arrays, not the model (``lint-imports`` holds the same
contract; this test counts imports inside functions and under ``TYPE_CHECKING`` too).
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_PARAMETERS = {"batched", "projection"}


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = node.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]


def seam_parameters(top: Path) -> list[str]:
    """``file:function(parameter)`` for each forbidden parameter: every function of ``model/``, the
    public ones (no leading ``_``) of ``kernels/``."""
    found = []
    for folder, public_only in (("model", False), ("kernels", True)):
        for path in sorted((top / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if public_only and node.name.startswith("_") and node.name != "__init__":
                    continue
                found += [
                    f"{folder}/{path.name}:{node.name}({p})" for p in _parameters(node) if p in FORBIDDEN_PARAMETERS
                ]
    return found


def transformer_imports(top: Path) -> list[str]:
    """``file -> module`` for every import of ``minillm.model.transformer`` (or of ``Transformer`` from
    ``minillm.model``) in ``kernels/``, anywhere in the file."""
    found = []
    for path in sorted((top / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"kernels/{path.name} -> {n}" for n in names if n == "minillm.model.transformer"]
    return found


def test_no_parameter_names_a_projection_or_a_batch_across_the_seam():
    assert seam_parameters(ROOT / "minillm") == []


def test_the_engine_room_imports_nothing_from_the_transformer():
    assert transformer_imports(ROOT / "minillm") == []
    assert (ROOT / "minillm" / "kernels" / "tuned.py").exists()  # the engine room is there to be checked


def test_a_flag_or_an_import_planted_in_the_engine_room_is_found(tmp_path):
    shutil.copytree(ROOT / "minillm", tmp_path / "minillm", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "minillm" / "kernels" / "leak.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from minillm.model import transformer\n"
        "def linear(x, w, *, projection=None):\n    import minillm.model.transformer\n"
        "def _private(x, batched=False):\n    return x\n"
    )
    (tmp_path / "minillm" / "model" / "leak.py").write_text("def _step(x, *, batched=False):\n    return x\n")
    assert transformer_imports(tmp_path / "minillm") == [
        "kernels/leak.py -> minillm.model.transformer",
        "kernels/leak.py -> minillm.model.transformer",
    ]
    assert seam_parameters(tmp_path / "minillm") == [
        "model/leak.py:_step(batched)",
        "kernels/leak.py:linear(projection)",
    ]
