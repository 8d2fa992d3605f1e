"""``minillm serve``: check the flags (access included: ``auth.py``, before any socket is bound), build the
worker and the app, then run uvicorn (HTTPS with ``--ssl-certfile`` and ``--ssl-keyfile``)."""

from __future__ import annotations

import argparse
import errno
import socket
import ssl

from rich.console import Console
from rich.markup import escape


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C; returns the exit status: 0 after a drain (``shutdown.py``),
    1 when a second signal cut it short, 2 for a bad flag or a model that cannot fit.

    The socket listens at once; the model loads on the worker thread (GET /health: 503, then 200).
    A port already in use ends it at once (status 2, before the banner): nothing was started.
    One model or several (``multi_server.py``), the same :func:`serve_app` runs the app.
    """
    import minillm

    from .auth import access_from_args
    from .flags import base_url

    err = Console(stderr=True)
    try:
        problem = flag_problem(args) or tls_problem(args) or adapter_problem(args)
        access = access_from_args(args) if problem is None else None  # keys read, the host checked: before bind
    except ValueError as exc:
        problem = str(exc)
    if problem is not None:
        err.print(f"[bold red]error:[/] {escape(problem)}", highlight=False)  # e.g. ssl's "[SSL] ..." is not markup
        return 2
    try:
        speculative = (
            minillm.Speculative(draft=args.speculative, num_tokens=args.num_speculative_tokens)
            if args.speculative
            else None
        )
    except minillm.MiniLLMError as exc:
        err.print(f"[bold red]error:[/] --speculative / --num-speculative-tokens: {exc}")
        return 2
    console = Console(highlight=False)
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        err.print(f"[bold red]error:[/] {port_problem(args.host, args.port, exc)}", soft_wrap=True)
        return 2
    if _several_models(args):  # models.py: plans, on-demand loads, eviction
        from .multi_server import build_registry_app

        built = build_registry_app(args, console, err, speculative, access)
        if built is None:  # a model that cannot fit, or a name given twice: said on stderr
            sock.close()
            return 2
    else:
        built = _one_model_app(args, console, speculative, access)
    app, guard = built
    console.print(access.banner())
    if args.open:
        _open_page(console, f"{base_url(args)}/ui")
    if args.test_faults:
        console.print("minillm serve: --test-faults: requests may ask for an injected fault (tests only)")
    return serve_app(app, guard, sock, args, console)


def flag_problem(args: argparse.Namespace) -> str | None:
    """The first flag of ``minillm serve`` out of its range, said as the fix; None when all are good."""
    checks = [
        (args.max_queue >= 1, "--max-queue must be >= 1"),
        (args.threads is None or args.threads >= 1, "--threads must be >= 1"),
        (args.request_timeout is None or args.request_timeout > 0, "--request-timeout must be > 0 seconds"),
        (args.max_seq_len is None or args.max_seq_len >= 2, "--max-seq-len must be >= 2"),
        (args.keep_traces >= 1, "--keep-traces must be >= 1"),
        (args.startup_delay >= 0, "--startup-delay must be >= 0 seconds"),
        (args.max_num_seqs >= 1, "--max-num-seqs must be >= 1"),
        (args.kv_cache_mib is None or args.kv_cache_mib > 0, "--kv-cache-mib must be > 0"),
        (args.max_loaded_models is None or args.max_loaded_models >= 1, "--max-loaded-models must be >= 1"),
        (args.max_batched_tokens >= 1, "--max-batched-tokens must be >= 1"),
        (args.block_size >= 1, "--block-size must be >= 1"),
        (args.events_buffer >= 1, "--events-buffer must be >= 1"),
        (args.max_event_subscribers >= 1, "--max-event-subscribers must be >= 1"),
        (args.shutdown_timeout >= 0, "--shutdown-timeout must be >= 0 seconds"),
        (args.stream_buffer >= 1, "--stream-buffer must be >= 1 chunks"),
        (args.max_request_bytes >= 1, "--max-request-bytes must be >= 1"),
        (args.max_header_bytes >= 1024, "--max-header-bytes must be >= 1024"),
        (args.socket_send_buffer >= 4096, "--socket-send-buffer must be >= 4096 bytes"),
    ]
    return next((message for ok, message in checks if not ok), None)


def adapter_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--adapter`` (before anything loads), said as the fix; None when it is good
    or absent. Every served model merges the adapters into its weights at load (one model, or each of
    the registry's). Refused: a folder that is not a LoRA adapter, with the message ``minillm.load``
    gives (``lora.check_adapter_folder``), and a model held as packed GGUF blocks (the case
    ``loading.check_weight_dtype`` refuses). Shapes that do not fit a model are found by its load:
    GET /health then answers 503 with the error (the first model), or its requests get it (a later one)."""
    from minillm.errors import AdapterError
    from minillm.model.lora import check_adapter_folder

    from .model_spec import ModelSpec

    if not args.adapters:
        return None
    for text in (args.model, *args.models):
        if ModelSpec.parse(text).weight_dtype == "gguf":  # as check_weight_dtype (--weight-dtype has no gguf)
            return (
                f"--adapter cannot be merged into {text} held at gguf: its weights stay packed GGUF blocks, "
                "and a LoRA delta is merged into float32 rows; serve it at float32, bfloat16 or int8 "
                "(drop its :gguf)"
            )
    for folder in args.adapters:
        try:
            check_adapter_folder(folder)
        except AdapterError as exc:
            return f"--adapter {folder}: AdapterError: {exc}"
    return None


def tls_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--ssl-certfile`` / ``--ssl-keyfile`` (both or neither; a pair Python's ssl
    loads), said as the fix; None when they are good or absent."""
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        return "HTTPS needs both --ssl-certfile and --ssl-keyfile (the certificate and its private key)"
    if args.ssl_certfile is None:
        return None
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        return f"cannot use --ssl-certfile {args.ssl_certfile} with --ssl-keyfile {args.ssl_keyfile}: {exc}"
    return None


def _one_model_app(args: argparse.Namespace, console: Console, speculative, access=None):
    """(app, guard) for one model on one :class:`~minillm.serve.worker.Worker`; prints the banner.
    ``access``: keys, quotas and the rest (``auth.Access``; None: an open server)."""
    from .app import create_app
    from .events import EventBus
    from .flags import adapted, base_url, worker_options
    from .metrics import ServerMetrics
    from .reliability import Guard
    from .worker import Worker

    metrics = ServerMetrics()
    served = args.served_model_name or args.model
    worker = Worker(
        args.model,
        metrics=metrics,
        served_name=served,
        adapters=args.adapters,
        **worker_options(args, console),
        kv_cache_mib=args.kv_cache_mib if args.kv_cache_mib is not None else 512.0,
        events=EventBus(args.events_buffer, args.max_event_subscribers, log=console.print),
        guard=Guard(metrics, stream_buffer=args.stream_buffer, test_faults=args.test_faults),
        speculative=speculative,
    )
    app = create_app(worker, max_request_bytes=args.max_request_bytes, access=access)
    console.print(
        f"minillm serve: {served}{adapted(args)} on {base_url(args)} (loading in the background; GET /health "
        "answers 200 when ready)"
    )
    return app, worker.guard


def serve_app(app, guard, sock: socket.socket, args: argparse.Namespace, console: Console) -> int:
    """Run ``app`` under uvicorn on ``sock`` until the drain ends; the one start of every server.

    What wraps it, for one model or several: the 413 on a declared ``Content-Length`` over
    ``--max-request-bytes`` (``limits.py``), uvicorn's h11 with small write buffers and the header
    limit ``--max-header-bytes``, the kernel send buffer ``--socket-send-buffer``, and the drain on
    the first SIGTERM/SIGINT (``shutdown.py``). Returns 0 after a drain, 1 after a second signal.
    """
    import uvicorn

    from .limits import DeclaredLengthLimit
    from .shutdown import DrainingServer, SmallBufferH11

    refused = guard.counters.refused.labels(reason="body_too_large")
    config = uvicorn.Config(
        DeclaredLengthLimit(app, args.max_request_bytes, on_refused=refused.inc),
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=2,  # after the drain: only the last bytes of answers are left to send
        http=SmallBufferH11,  # uvicorn's h11: its header limit is the one --max-header-bytes sets
        h11_max_incomplete_event_size=args.max_header_bytes,
        ssl_certfile=args.ssl_certfile,  # HTTPS when given (checked by tls_problem before the bind)
        ssl_keyfile=args.ssl_keyfile,
    )
    server = DrainingServer(config, guard, args.shutdown_timeout, console)
    # `sock`, bound before the banner (a port in use is said first): accepted connections inherit its
    # send buffer, so what the kernel holds for a slow reader stays small, the stream's own buffer
    # (--stream-buffer) fills and the request is shed instead of piling up.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, args.socket_send_buffer)
    server.run(sockets=[sock])
    return 1 if server.forced else 0


def _open_page(console: Console, url: str) -> None:
    """Print the live page's URL and ask the desktop's browser to open it (nothing happens
    without one: a server over SSH prints the URL only)."""
    import webbrowser

    console.print(f"minillm serve: the live page is {url}")
    try:
        opened = webbrowser.open(url)
    except Exception:  # noqa: BLE001 - no usable browser: the printed URL is enough
        opened = False
    if not opened:
        console.print("minillm serve: no browser to open here; open the URL above yourself")


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (as uvicorn binds one: SO_REUSEADDR), not yet listening.

    Raises:
        OSError: the port is in use (``errno.EADDRINUSE``), the host is unknown, or the port is not ours to take.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def port_problem(host: str, port: int, exc: OSError) -> str:
    """One sentence: why ``host:port`` could not be bound, and the fix."""
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use (another server, or an earlier minillm serve still "
            f"running); stop it, or pass another port with --port"
        )
    return f"cannot listen on {host}:{port} ({exc.strerror or exc}); check --host and --port"


def _several_models(args: argparse.Namespace) -> bool:
    """True when a flag of models.py is in use; one plain model keeps the single-model worker."""
    flags = (args.memory_budget, args.keep_alive, args.max_loaded_models, args.weight_dtype)
    return bool(args.models) or any(f is not None for f in flags) or ":" in args.model
