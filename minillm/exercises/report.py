"""What the grader shows: a rich table (terminal and Jupyter) and JSON for a teacher's script."""

from __future__ import annotations

import json

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from minillm.exercises.grade import Verdict

STYLE = {"passed": "green", "failed": "red", "not started": "yellow"}


def lesson_label(lesson: str) -> str:
    """``03_causal_mask_and_attention`` -> ``lesson 3``; a textbook file by its name."""
    head = lesson.split("_", 1)[0]
    return f"lesson {int(head)}" if head.isdigit() else lesson.rsplit("/", 1)[-1]


def verdict_table(verdicts: list[Verdict], title: str = "minillm exercises") -> Group:
    """One row per unit (unit, lesson, status, stage, what failed and the hint), then each failure's
    traceback (the student's frames) in a panel."""
    passed = sum(v.status == "passed" for v in verdicts)
    seed = verdicts[0].seed if verdicts else 0
    table = Table(title=f"{title}: {passed} of {len(verdicts)} passed (seed {seed})", show_lines=True)
    for column in ("unit", "lesson", "status", "stage", "what happened"):
        table.add_column(column, overflow="fold")
    for v in verdicts:
        detail = Text()
        if v.case:
            detail.append(v.case + "\n", style="bold")
        detail.append(v.message)
        if v.hint:
            detail.append("\nhint: " + v.hint, style="cyan")
        status = Text(v.status, style=STYLE.get(v.status, ""))
        table.add_row(v.unit, lesson_label(v.lesson), status, v.stage, detail)
    panels = [
        Panel(escape(v.traceback), title=f"{v.unit}: your code's traceback", border_style="red")
        for v in verdicts
        if v.traceback
    ]
    return Group(table, *panels)


def show(verdicts: list[Verdict], console: Console | None = None) -> None:
    """Print :func:`verdict_table` on ``console`` (default: stdout)."""
    (console or Console()).print(verdict_table(verdicts))


def as_json(verdicts: list[Verdict]) -> str:
    """``{"passed": n, "failed": n, "not_started": n, "units": [verdict, ...]}`` as JSON text."""
    counts = {k.replace(" ", "_"): sum(v.status == k for v in verdicts) for k in ("passed", "failed", "not started")}
    return json.dumps({**counts, "units": [v.as_dict() for v in verdicts]}, indent=1)


class Shown:
    """A verdict list that displays itself: as the rich table in a terminal (``__rich__``) and as its
    HTML in Jupyter (``_repr_html_``). ``.verdicts``; ``.passed`` is True when all passed."""

    def __init__(self, verdicts: list[Verdict]):
        self.verdicts = verdicts
        self.passed = bool(verdicts) and all(v.status == "passed" for v in verdicts)

    def __rich__(self):
        return verdict_table(self.verdicts)

    def _repr_html_(self) -> str:
        console = Console(record=True, width=120, file=_Discard())
        console.print(verdict_table(self.verdicts))
        return console.export_html(inline_styles=True, code_format="<pre style='font-family:monospace'>{code}</pre>")

    def __repr__(self) -> str:
        return "; ".join(
            f"{v.unit}: {v.status}" + (f" ({v.message})" if v.status != "passed" else "") for v in self.verdicts
        )


class _Discard:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
