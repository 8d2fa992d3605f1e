"""``minillm serve``: build the worker and the app, then run uvicorn."""

from __future__ import annotations

import argparse

from rich.console import Console


def run_server(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C; returns the exit status (2 for a bad flag).

    The socket listens at once; the model loads on the worker thread (GET /health: 503, then 200).
    """
    import uvicorn

    from .app import create_app
    from .metrics import ServerMetrics
    from .worker import Worker

    err = Console(stderr=True)
    checks = [
        (args.max_queue >= 1, "--max-queue must be >= 1"),
        (args.threads is None or args.threads >= 1, "--threads must be >= 1"),
        (args.request_timeout is None or args.request_timeout > 0, "--request-timeout must be > 0 seconds"),
        (args.max_seq_len is None or args.max_seq_len >= 2, "--max-seq-len must be >= 2"),
        (args.keep_traces >= 1, "--keep-traces must be >= 1"),
        (args.startup_delay >= 0, "--startup-delay must be >= 0 seconds"),
        (args.max_num_seqs >= 1, "--max-num-seqs must be >= 1"),
        (args.kv_cache_mib > 0, "--kv-cache-mib must be > 0"),
        (args.max_batched_tokens >= 1, "--max-batched-tokens must be >= 1"),
        (args.block_size >= 1, "--block-size must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            err.print(f"[bold red]error:[/] {message}")
            return 2
    import minillm

    try:
        speculative = minillm.Speculative(args.speculative, args.num_speculative_tokens) if args.speculative else None
    except minillm.MiniLLMError as exc:
        err.print(f"[bold red]error:[/] --speculative / --num-speculative-tokens: {exc}")
        return 2
    console = Console(highlight=False)
    worker = Worker(
        args.model,
        metrics=ServerMetrics(),
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        max_seq_len=args.max_seq_len,
        threads=args.threads,
        warmup=not args.no_warmup,
        verbosity=args.verbosity,
        console=console,
        startup_delay_s=args.startup_delay,
        keep_traces=args.keep_traces,
        max_num_seqs=args.max_num_seqs,
        kv_cache_mib=args.kv_cache_mib,
        max_batched_tokens=args.max_batched_tokens,
        block_size=args.block_size,
        speculative=speculative,
    )
    served = args.served_model_name or args.model
    app = create_app(worker, served)
    console.print(
        f"minillm serve: {served} on http://{args.host}:{args.port} (loading in the background; "
        "GET /health answers 200 when ready)"
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)
    return 0
