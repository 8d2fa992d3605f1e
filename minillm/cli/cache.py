"""``minillm cache``: what the cache holds (models, MiB), and ``minillm cache rm NAME`` to take one out."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table


def add_cache_command(sub) -> None:
    """``cache`` (list) and ``cache rm NAME ...`` (remove) on the CLI's subparsers."""
    p = sub.add_parser("cache", help="list the models in minillm's cache with their sizes; `cache rm NAME` removes one")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    actions = p.add_subparsers(dest="cache_command")
    rm = actions.add_parser("rm", help="remove models from the cache (the next use fetches them again)")
    rm.add_argument("names", nargs="+", metavar="NAME", help="a model name as `minillm cache` lists it")
    rm.add_argument("--debug", action="store_true", help="show tracebacks")


def run_cache(args: argparse.Namespace, console: Console) -> int:
    """List the cache, or remove the models named; returns the exit status.

    Raises:
        ModelNotFoundError: ``rm`` of a name the cache does not hold (nothing is removed then).
    """
    from minillm.errors import ModelNotFoundError
    from minillm.sources.cache import cached_models, remove_cached
    from minillm.sources.hub import cache_root

    root = cache_root()
    if args.cache_command != "rm":
        return _list(console, root, cached_models(root))
    held = {m.name for m in cached_models(root)}
    missing = [n for n in args.names if n.strip().lower() not in held]
    if missing:  # check them all first: a typo removes nothing
        raise ModelNotFoundError(
            f"the cache at {root} holds no model {missing[0]!r} (it holds {', '.join(sorted(held)) or 'nothing'}); "
            "`minillm cache` lists it"
        )
    for name in args.names:
        gone = remove_cached(name, root)
        folders = ", ".join(str(f) for f in gone.folders)
        console.print(f"removed {gone.name}: {gone.mib:,.1f} MiB freed ({folders})", soft_wrap=True)
    return 0


def _list(console: Console, root, models) -> int:
    if not models:
        console.print(f"the cache at {root} holds no model", soft_wrap=True)
        return 0
    console.print(f"minillm's cache: {root}", soft_wrap=True)
    table = Table()
    table.add_column("name", no_wrap=True)
    table.add_column("MiB", justify="right")
    table.add_column("state")
    table.add_column("folders", overflow="fold")
    for m in models:
        state = ("complete" if m.complete else "incomplete") + (" + GGUF" if m.gguf else "")
        folders = "\n".join(str(f.relative_to(root)) for f in m.folders)
        table.add_row(m.name, f"{m.mib:,.1f}", state, folders)
    console.print(table)
    total = sum(m.bytes for m in models) / (1 << 20)
    console.print(
        f"{len(models)} model{'s' if len(models) != 1 else ''}, {total:,.1f} MiB; `minillm cache rm NAME` removes one"
    )
    return 0
