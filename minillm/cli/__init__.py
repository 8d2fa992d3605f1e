"""The ``minillm`` command: run a traced request, chat, or list the models it knows.

    minillm run "The capital of France is"          # completion, traced
    minillm chat "What is the capital of France?"   # through the chat template
    minillm chat                                    # a conversation on the terminal (Ctrl-D leaves)
    minillm chat --file examples/incident.txt "Summarize this incident report in two bullets."
    cat report.txt | minillm chat --file - "Summarize this."   # the attachment from stdin
    minillm models                                  # the manifest
    minillm cache                                   # what is cached (MiB); `minillm cache rm NAME` removes one
    minillm calibrate                               # measure this machine again (the diagnosis's rates)
    minillm serve                                   # an OpenAI-compatible server (minillm/serve, extra: serve)
    minillm bench --url http://127.0.0.1:8000 --concurrency 1,2,4   # a load generator: a client (bench.py)
    minillm exercises start my_units                # your turn: stubs of the textbook's units
    minillm exercises check --dir my_units          # graded against the textbook, then inside SmolLM2
    minillm run --units my_units "The capital of France is"   # the request on your units
    minillm book --out build/book                   # the course book: the lessons as executed, a static site
    minillm deploy MODEL --replicas 2               # the server as Ray Serve replicas (minillm/deploy, extra: deploy)

Errors minillm raises on purpose (``MiniLLMError``) print as one clear message, no traceback
(``--debug`` shows it), and exit with status 2.

Ctrl-C during a request cancels it cleanly: the step in progress finishes, the partial text and
the trace (stop reason "cancelled") are printed, and the exit status is 130 (the shell's code for
"interrupted by the user"). A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from minillm.cli.book import add_book_command
from minillm.cli.cache import add_cache_command, run_cache
from minillm.cli.chat import run_conversation
from minillm.cli.deploy import add_deploy_command
from minillm.cli.exercises import add_exercises_command
from minillm.cli.options import add_request_args, bare_verbosity
from minillm.cli.request import run_request
from minillm.errors import MiniLLMError
from minillm.serve import DEFAULT_MODEL, require_extra
from minillm.serve import add_commands as add_serve_commands


def build_parser() -> argparse.ArgumentParser:
    from minillm import __version__  # the installed distribution's (minillm-edu), else the checkout's

    parser = argparse.ArgumentParser(prog="minillm", description="A traced, from-scratch NumPy LLM runtime.")
    parser.add_argument("--version", action="version", version=f"minillm {__version__}")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="complete a prompt (no chat template), with a trace")
    add_request_args(run)
    chat = sub.add_parser("chat", help="answer a user message through the model's chat template")
    add_request_args(chat, conversation=True)
    chat.add_argument("--system", default=None, help="an optional system message")
    models = sub.add_parser("models", help="list the models in weights_manifest.toml")
    models.add_argument("--debug", action="store_true")
    add_serve_commands(sub)
    _add_bench_command(sub)
    add_cache_command(sub)
    add_exercises_command(sub)
    add_book_command(sub)
    add_deploy_command(sub)
    cal = sub.add_parser(
        "calibrate",
        help="measure this machine's rates (bandwidth, GEMM, disk) again; the diagnosis compares each phase with them",
    )
    cal.add_argument("--threads", type=int, default=None, metavar="N", help="BLAS threads to measure with")
    cal.add_argument("--debug", action="store_true")
    return parser


def _add_bench_command(sub) -> None:
    """``minillm bench``: load-test an OpenAI-compatible server, or switch between models (``--models``)."""
    b = sub.add_parser("bench", help="load-test an OpenAI-compatible server (minillm, vLLM, llama.cpp)")
    b.add_argument(
        "--models",
        default=None,
        metavar="A,B",
        help="switching bench (bench_switch.py): requests one at a time over these models, in --pattern order",
    )
    b.add_argument(
        "--pattern",
        default="alternate,sticky",
        help="with --models: alternate (every request switches), sticky (one block per model), or both "
        "(default: %(default)s)",
    )
    b.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the server's base URL, without /v1 (default: %(default)s)"
    )
    b.add_argument("--model", default=DEFAULT_MODEL, help="the model name the server expects (default: %(default)s)")
    b.add_argument(
        "--concurrency", default="1,2,4,8", help="comma-separated client counts, one level each (default: %(default)s)"
    )
    b.add_argument(
        "--requests", type=int, default=16, metavar="N", help="requests per concurrency level (default: %(default)s)"
    )
    b.add_argument(
        "--prompt-tokens",
        type=int,
        default=64,
        metavar="P",
        help="prompt length, about P tokens (default: %(default)s)",
    )
    b.add_argument(
        "--max-tokens", type=int, default=32, metavar="T", help="max_tokens of each request (default: %(default)s)"
    )
    b.add_argument(
        "--json", default=None, metavar="PATH", help="write the results here (default: bench-results/bench-<time>.json)"
    )
    b.add_argument(
        "--timeout", type=float, default=300.0, metavar="S", help="HTTP timeout per request, s (default: %(default)s)"
    )
    b.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="sent as `Authorization: Bearer KEY` on every request (default: the MINILLM_API_KEY environment "
        "variable, if set)",
    )
    b.add_argument("--debug", action="store_true", help="show tracebacks")
    b.set_defaults(run_command=_bench)


def _bench(args: argparse.Namespace) -> int:
    require_extra("bench", ("httpx",))
    if args.models:  # switching between models (bench_switch.py)
        from minillm.cli.bench_switch import run_switch_command

        return run_switch_command(args)
    from minillm.cli.bench import run_bench_command

    return run_bench_command(args)


def _cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    from minillm.observe import calibrate
    from minillm.runtime.loading import set_blas_threads

    set_blas_threads(args.threads)
    console.print("measuring this machine (a few seconds) ...")
    machine = calibrate.machine(remeasure=True)
    table = Table(title="this machine's rates", title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="cyan")
    table.add_column(justify="right")
    for row in machine.rows():
        table.add_row(*row)
    console.print(table)
    where = (
        f"this machine ({machine.fingerprint['cpu']}, {machine.fingerprint['cores']} cores, "
        f"{machine.fingerprint['blas_threads']} BLAS threads)"
    )
    if machine.busy:
        console.print(
            f"[yellow]not kept[/]: other processes kept {machine.others_cores:.1f} cores busy while measuring, so "
            f"these rates are theirs as much as {where}'s; the cache keeps none of them and the next use "
            "measures again. Run `minillm calibrate` again on a quiet machine."
        )
        return 0
    console.print(f"cached in {calibrate.calibration_file()} for {where}")
    return 0


def _cmd_models(console: Console) -> int:
    from minillm.sources.hub import cache_root
    from minillm.sources.manifest import load_manifest

    table = Table(title="models (weights_manifest.toml)", title_justify="left")
    for col in ("name", "family", "license", "cached"):
        table.add_column(col)
    table.add_column("sources", overflow="fold")  # package and repo names wrap, never cut short
    for name, entry in load_manifest().items():
        sources = []
        if entry.hub is not None:
            sources.append(f"hub {entry.hub.repo}")
        if entry.offline is not None:
            sources.append(f"offline {entry.offline.summary()}")
        cached = "yes" if (cache_root() / "models" / name).is_dir() else "no"
        table.add_row(
            name + (" (default)" if entry.default else ""), entry.family, entry.license, cached, "\n".join(sources)
        )
    console.print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``minillm`` console script; returns the exit status."""
    import sys

    parser = build_parser()
    args = parser.parse_args(bare_verbosity(sys.argv[1:] if argv is None else list(argv)))
    if args.command is None:
        parser.print_help()
        return 2
    console = Console(highlight=False)
    try:
        if args.command == "models":
            return _cmd_models(console)
        if args.command == "calibrate":
            return _cmd_calibrate(args, console)
        if args.command == "cache":
            return run_cache(args, console)
        if args.command == "chat" and args.prompt is None:
            return run_conversation(args, console)
        if hasattr(args, "run_command"):  # serve (minillm/serve), bench (bench.py), exercises, book
            return args.run_command(args)
        return run_request(args, console)
    except MiniLLMError as exc:
        if args.debug:
            raise
        message = getattr(exc, "cli_message", None) or str(exc)  # the option as typed here: --max-seq-len
        Console(stderr=True).print(f"[bold red]error:[/] {type(exc).__name__}: {escape(message)}", highlight=False)
        return 2
    except KeyboardInterrupt:
        Console(stderr=True).print("[yellow]interrupted[/]")
        return 130
