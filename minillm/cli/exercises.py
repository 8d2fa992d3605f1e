"""``minillm exercises``: write a student's stubs, and grade them.

    minillm exercises start DIR                     # one stub per unit; a file you changed is kept
    minillm exercises check [UNIT ...] --dir DIR    # a table, one row per unit; exit 0 only if all pass
    minillm exercises check --dir DIR --json        # the same verdicts as JSON (a teacher's script)
    minillm exercises list                          # the units and the lesson of each

The grading itself is ``minillm/exercises`` (``grade.py``); this module parses and prints.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from minillm.exercises import DEFAULT_TIMEOUT, UNITS, Grading, as_json, exit_status, show, start
from minillm.exercises.grade import grade_folder
from minillm.exercises.report import lesson_label
from minillm.exercises.units import BY_NAME


def add_exercises_command(sub) -> None:
    """The ``exercises`` command and its ``start``, ``check`` and ``list`` subcommands."""
    ex = sub.add_parser("exercises", help="your turn: write the textbook's units and have them graded")
    ex.add_argument("--debug", action="store_true", help="show tracebacks of minillm's own errors")
    steps = ex.add_subparsers(dest="step", required=True)
    s = steps.add_parser("start", help="write one stub file per unit into DIR (never over a file you changed)")
    s.add_argument("dir", metavar="DIR", help="the folder for your units (made if missing)")
    c = steps.add_parser("check", help="grade the units in --dir: against the textbook, then in the model")
    c.add_argument("units", nargs="*", metavar="UNIT", help=f"units to grade (default: all): {', '.join(BY_NAME)}")
    c.add_argument("--dir", required=True, metavar="DIR", help="the folder made by `minillm exercises start`")
    c.add_argument("--json", action="store_true", help="print the verdicts as JSON instead of a table")
    c.add_argument("--seed", type=int, default=0, help="seed of the generated cases (default: %(default)s)")
    c.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help="seconds a unit may take before it is stopped and failed (default: %(default)s)",
    )
    steps.add_parser("list", help="the units, the lesson of each, and how each is graded")
    ex.set_defaults(run_command=run_exercises)


def run_exercises(args: argparse.Namespace) -> int:
    """Run ``minillm exercises ...``; returns the exit status (``check``: 0 only if every unit passed;
    2 for an unknown unit or a bad folder, as every minillm error)."""
    console = Console(highlight=False)
    if args.step == "list":
        table = Table(title="the units", title_justify="left")
        table.add_column("unit", no_wrap=True)
        table.add_column("lesson", no_wrap=True)
        table.add_column("graded second")
        for u in UNITS:
            table.add_row(
                u.name,
                lesson_label(u.lesson),
                {"model": "in the model"}.get(u.inside, u.inside) or f"unit cases only: {u.why}",
            )
        console.print(table)
        return 0
    if args.step == "start":
        done = start(args.dir)
        console.print(f"wrote {len(done['written'])} stubs into {escape(args.dir)}")
        if done["kept"]:
            console.print(f"[yellow]kept[/] (changed by you, not overwritten): {escape(', '.join(done['kept']))}")
        console.print(f"next: minillm exercises check --dir {escape(args.dir)}")
        return 0
    unknown = [u for u in args.units if u not in BY_NAME]
    if unknown:
        Console(stderr=True).print(
            f"[bold red]error:[/] no unit {escape(', '.join(unknown))}; the units are: {', '.join(BY_NAME)}"
        )
        return 2
    verdicts = grade_folder(args.dir, args.units or None, Grading(seed=args.seed, timeout=args.timeout))
    if args.json:
        print(as_json(verdicts))
    else:
        show(verdicts, console)
    return exit_status(verdicts)
