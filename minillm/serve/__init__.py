"""Serving minillm over HTTP (OpenAI's API) (lessons 10, 14, 17).

    minillm serve smollm2-135m-instruct --port 8000      # app.py + worker.py (extra: serve)

The load generator that measures it, ``minillm bench``, is a client: it lives in ``minillm/cli/bench.py``.
This ``__init__`` only adds the ``serve`` subcommand to the CLI; FastAPI and uvicorn are imported
when it runs, so ``minillm run`` works without the ``serve`` extra.
"""

from __future__ import annotations

import argparse
import importlib

from minillm.errors import MissingExtraError

DEFAULT_MODEL = "smollm2-135m-instruct"
#: the packages of the ``serve`` extra each command imports (pip names differ: prometheus-client)
NEEDS = {"serve": ("fastapi", "pydantic", "uvicorn", "prometheus_client")}


def add_commands(sub) -> None:
    """Add ``serve`` to the CLI's subparsers; it sets ``args.run_command(args) -> int``."""
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    s.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"name or local folder (default {DEFAULT_MODEL})")
    _add_multi_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests that may wait while others run; beyond, 429 with Retry-After (default 64)",
    )
    s.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="per-request deadline from arrival (queue wait included); the request then ends "
        "with finish_reason 'length' and minillm_stop_reason 'timed out'",
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the name clients pass as `model` (default: MODEL as given), e.g. a short name for a local folder",
    )
    s.add_argument("--max-seq-len", type=int, default=None, metavar="N", help="cap on each request's KV cache")
    s.add_argument(
        "--adapter",
        dest="adapters",
        action="append",
        default=[],
        metavar="FOLDER",
        help="a PEFT LoRA adapter folder merged into every served model's weights at load (repeatable); "
        "GET /v1/models names it",
    )
    _add_engine_args(s)
    s.add_argument("--threads", type=int, default=None, metavar="N", help="BLAS threads (default: all cores)")
    s.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    _add_observing_args(s)
    _add_access_args(s)
    _add_reliability_flags(s)
    s.add_argument("--debug", action="store_true")
    s.set_defaults(run_command=_serve)


def _add_engine_args(s) -> None:
    """The continuous batch, its KV-cache pool and speculative decoding (``runtime/scheduler.py``)."""
    s.add_argument("--max-num-seqs", type=int, default=16, metavar="N", help="requests running at once (default 16)")
    s.add_argument(
        "--kv-cache-mib",
        type=float,
        default=None,
        metavar="MIB",
        help="the paged KV-cache pool the running requests share (default 512, or with --memory-budget what "
        "the budget leaves); a request that could never fit is refused with 400",
    )
    s.add_argument(
        "--max-batched-tokens",
        type=int,
        default=512,
        metavar="N",
        help="tokens fed per step over all requests: long prompts go in chunks (default 512)",
    )
    s.add_argument("--block-size", type=int, default=16, metavar="N", help="positions per KV block (default 16)")
    s.add_argument("--speculative", default=None, metavar="DRAFT", help="default draft: ngram | self-int8 | layers:K")
    s.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K", help="drafted per pass (default 4)")


def _add_observing_args(s) -> None:
    """What the server shows of its requests: console traces, kept traces, the event stream, the live page."""
    s.add_argument(
        "--verbosity",
        "-v",
        choices=("quiet", "summary", "steps", "full"),
        default="summary",
        help="trace printed on the console for every request (default summary)",
    )
    s.add_argument(
        "--keep-traces",
        type=int,
        default=100,
        metavar="N",
        help="finished requests whose trace GET /v1/traces/{id} keeps (default 100)",
    )
    s.add_argument(
        "--startup-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long before loading, on purpose (tests watch /health answer 503; "
        "the /health JSON says the delay is deliberate)",
    )
    s.add_argument(
        "--events-buffer",
        type=int,
        default=4096,
        metavar="N",
        help="events GET /v1/events keeps for pages that reconnect (Last-Event-ID); a page further behind "
        "is dropped (default 4096)",
    )
    s.add_argument(
        "--max-event-subscribers",
        type=int,
        default=32,
        metavar="N",
        help="event streams (live pages) open at once; one more gets 503 (default 32)",
    )
    s.add_argument("--open", action="store_true", help="print the live page's URL (GET /ui) and open it in a browser")


def _add_access_args(s) -> None:
    """Keys, scopes, quotas, privacy, CORS and TLS: a server a teacher may put on a class's network (auth.py)."""
    s.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="an inference key (repeatable): with any key, every endpoint but /health needs "
        "`Authorization: Bearer KEY`; also read from the MINILLM_API_KEY environment variable",
    )
    s.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="FILE",
        help="inference keys, one a line (# starts a comment): keeps keys out of the process list",
    )
    s.add_argument(
        "--observer-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key for the projector (repeatable): may read /ui, /v1/events, /v1/traces and /metrics, gets 403 on "
        "generation",
    )
    s.add_argument(
        "--show-prompts",
        action="store_true",
        help="observers see other keys' prompts and answers (default: token counts and shapes only)",
    )
    s.add_argument("--log-prompts", action="store_true", help="the console's per-request trace includes its text")
    s.add_argument(
        "--no-auth",
        action="store_true",
        help="serve a non-loopback --host without keys (else refused: anyone there could generate and read prompts)",
    )
    s.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web origin whose pages may call this server, e.g. https://class.example (CORS; default none)",
    )
    quotas = "past it, 429 rate_limit_exceeded with Retry-After (needs keys; default: no limit)"
    s.add_argument("--requests-per-minute", type=int, default=None, metavar="N", help=f"per key; {quotas}")
    s.add_argument(
        "--tokens-per-minute", type=int, default=None, metavar="N", help=f"prompt + completion, per key; {quotas}"
    )
    s.add_argument("--max-concurrent-per-key", type=int, default=None, metavar="N", help=f"in flight; {quotas}")
    s.add_argument("--ssl-certfile", default=None, metavar="PEM", help="serve HTTPS with this certificate (uvicorn's)")
    s.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key")


def _add_reliability_flags(s) -> None:
    """Shutdown, backpressure, size limits and the fault hook (``shutdown.py``, ``reliability.py``, ``limits.py``)."""
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="after SIGTERM/SIGINT, how long requests in flight may still run; then they are cancelled "
        "(default 30); a second signal exits at once",
    )
    s.add_argument(
        "--stream-buffer",
        type=int,
        default=256,
        metavar="N",
        help="text chunks a stream may have waiting for a slow client; past it the request is cancelled (default 256)",
    )
    s.add_argument(
        "--socket-send-buffer",
        type=int,
        default=16384,
        metavar="BYTES",
        help="kernel send buffer of each connection (SO_SNDBUF; Linux doubles it); small, so a slow reader "
        "is noticed by --stream-buffer (default 16384)",
    )
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 * 2**20,
        metavar="N",
        help="largest request body; beyond, 413 (default 4 MiB)",
    )
    s.add_argument(
        "--max-header-bytes",
        type=int,
        default=16384,
        metavar="N",
        help="largest request head (uvicorn h11's limit; beyond, 400) (default 16384)",
    )
    s.add_argument(
        "--test-faults",
        action="store_true",
        help="accept the minillm_test_fault request field, which raises inside that request on purpose, or holds "
        "its admission (tests)",
    )


def require_extra(command: str, modules: tuple[str, ...] | None = None) -> None:
    """Import the packages ``minillm <command>`` needs (``modules``, default ``NEEDS[command]``), before any work.

    Raises:
        MissingExtraError: one is not installed; the message names the ``serve`` extra to install.
    """
    for module in NEEDS[command] if modules is None else modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] != module:
                raise  # the package is there but one of its own dependencies is not: pip's message says which
            raise MissingExtraError.for_module(module, "serve", f"minillm {command}") from None


def _add_multi_model_args(s) -> None:
    """Several models behind one server (models.py); MODEL[:DTYPE] holds a model at that weight dtype."""
    s.add_argument(
        "--model",
        dest="models",
        action="append",
        default=[],
        metavar="NAME[:DTYPE]",
        help="one more model to serve, loaded on demand (repeatable); a :float32, :bfloat16 or :int8 suffix "
        "holds its weights at that precision (clients name it with the suffix)",
    )
    s.add_argument(
        "--weight-dtype",
        choices=("float32", "bfloat16", "int8"),
        default=None,
        help="how models without a :DTYPE suffix hold their weights (default float32)",
    )
    s.add_argument(
        "--memory-budget",
        type=_size,
        default=None,
        metavar="SIZE",
        help="bytes all loaded models may use, e.g. 2GiB or 1536MiB; a model that cannot hold one full-context "
        "request is refused at startup, and loading past it evicts the least recently used idle model",
    )
    s.add_argument(
        "--keep-alive",
        type=_keep_alive,
        default=None,
        metavar="SECONDS",
        help="how long an idle model stays loaded (0: unload as soon as it is idle; -1: never; default -1)",
    )
    s.add_argument(
        "--max-loaded-models", type=int, default=None, metavar="N", help="models loaded at once (default: no limit)"
    )


def _size(text: str) -> int:
    from minillm.errors import InvalidRequestError
    from minillm.runtime.memory_plan import parse_size

    try:
        return parse_size(text)
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _keep_alive(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = None
    if seconds is None or seconds != seconds or seconds < -1:
        raise argparse.ArgumentTypeError(
            f"--keep-alive takes seconds >= 0, or -1 to never unload an idle model; got {text!r}"
        )
    return seconds


def _serve(args: argparse.Namespace) -> int:
    require_extra("serve")
    from .server import run_server

    return run_server(args)
