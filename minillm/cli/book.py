"""``minillm book``: build the course book, a static site of the lessons with the outputs of the run
that tested them.

    minillm book --out build/book                  # in a checkout; then open build/book/index.html
    minillm book --lessons 01_lifecycle,04_prefill_vs_decode --out /tmp/book
    python -m http.server 8000 --directory build/book   # a classroom reads it at http://<this machine>:8000/

The building is ``minillm/book`` (``site.py``); this module parses and prints.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from minillm.book.lessons import KEPT
from minillm.book.site import build_book, find_checkout


def add_book_command(sub) -> None:
    """The ``book`` command: its flags, and ``args.run_command`` = :func:`run_book`."""
    b = sub.add_parser("book", help="build the course book: a static site of the lessons as executed (book extra)")
    b.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the site lands (default: build/book in the checkout)",
    )
    b.add_argument(
        "--lessons",
        default=None,
        metavar="NAMES",
        help="comma-separated lessons, e.g. 01_lifecycle,04_prefill_vs_decode (default: all)",
    )
    b.add_argument(
        "--kept",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"the executed copies (default: {KEPT} in the checkout, kept by the test run)",
    )
    b.add_argument(
        "--no-execute",
        action="store_true",
        help="stop, naming the lesson, instead of executing a lesson that has no executed copy",
    )
    b.add_argument("--rerun", action="store_true", help="execute every lesson again, even one with a kept copy")
    b.add_argument("--debug", action="store_true", help="show tracebacks of minillm's own errors")
    b.set_defaults(run_command=run_book)


def run_book(args: argparse.Namespace) -> int:
    """Build the book from the checkout around the working directory; 0 when built (errors exit 2)."""
    console = Console(highlight=False)
    checkout = find_checkout(Path.cwd())
    out = args.out or checkout / "build" / "book"
    names = [n.strip() for n in args.lessons.split(",") if n.strip()] if args.lessons else None
    book = build_book(
        checkout,
        out,
        names,
        kept=args.kept,
        execute_missing=not args.no_execute,
        rerun=args.rerun,
        say=lambda line: console.print(escape(line)),
    )
    executed = f", {len(book.executed)} executed by this build" if book.executed else ""
    console.print(
        f"the book: {escape(str(book.out / 'index.html'))} ({len(book.lessons)} lessons{executed}; "
        f"{book.seconds:.0f} s)"
    )
    console.print(f"serve it to a classroom: python -m http.server 8000 --directory {escape(str(book.out))}")
    return 0
