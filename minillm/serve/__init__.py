"""Serving minillm over HTTP (OpenAI's API) and measuring it under load (lesson 10).

    minillm serve smollm2-135m-instruct --port 8000      # app.py + worker.py (extra: serve)
    minillm bench --url http://127.0.0.1:8000 --model smollm2-135m-instruct --concurrency 1,2,4

This ``__init__`` only adds the two subcommands to the CLI; FastAPI, uvicorn and httpx are
imported when a command runs, so ``minillm run`` works without the ``serve`` extra.
"""

from __future__ import annotations

import argparse

DEFAULT_MODEL = "smollm2-135m-instruct"


def add_commands(sub) -> None:
    """Add ``serve`` and ``bench`` to the CLI's subparsers; each sets ``args.run_command(args) -> int``."""
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    s.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"name or local folder (default {DEFAULT_MODEL})")
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
    s.add_argument("--max-num-seqs", type=int, default=16, metavar="N", help="requests running at once (default 16)")
    s.add_argument(
        "--kv-cache-mib",
        type=float,
        default=512.0,
        metavar="MIB",
        help="the paged KV-cache pool the running requests share (default 512); a request that could never "
        "fit is refused with 400",
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
    s.add_argument("--threads", type=int, default=None, metavar="N", help="BLAS threads (default: all cores)")
    s.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
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
    s.add_argument("--debug", action="store_true")
    s.set_defaults(run_command=_serve)

    b = sub.add_parser("bench", help="load-test an OpenAI-compatible server (minillm, vLLM, llama.cpp)")
    b.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (without /v1)")
    b.add_argument("--model", default=DEFAULT_MODEL, help="the model name the server expects")
    b.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client counts, one level each")
    b.add_argument("--requests", type=int, default=16, metavar="N", help="requests per concurrency level")
    b.add_argument("--prompt-tokens", type=int, default=64, metavar="P", help="prompt length, about P tokens")
    b.add_argument("--max-tokens", type=int, default=32, metavar="T", help="max_tokens of each request")
    b.add_argument(
        "--json", default=None, metavar="PATH", help="write the results here (default bench-results/bench-<time>.json)"
    )
    b.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS", help="HTTP timeout per request")
    b.add_argument("--debug", action="store_true")
    b.set_defaults(run_command=_bench)


def _serve(args: argparse.Namespace) -> int:
    from .server import run_server

    return run_server(args)


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_bench_command

    return run_bench_command(args)
