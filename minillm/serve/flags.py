"""The serve command's flags as a :class:`~minillm.serve.worker.Worker`'s options: one model's worker
and every model slot of a multi-model server take the same ones; and the URL both print."""

from __future__ import annotations

import argparse

from rich.console import Console


def worker_options(args: argparse.Namespace, console: Console) -> dict:
    """The keyword arguments a Worker (or a ModelSlot) takes from ``minillm serve``'s flags: its
    queue bound and timeout (seconds), context, threads, warm-up, trace keeping and the scheduler's
    batch limits (sequences, tokens, block size), and whether its console trace shows the request's text
    (``--log-prompts``). The KV pool's size is the caller's (one model has
    a default; several share a budget)."""
    # the flags whose dest is the Worker's keyword itself, then the four that are renamed or turned
    same = ("max_queue", "max_seq_len", "threads", "verbosity", "keep_traces", "max_num_seqs", "max_batched_tokens")
    options = {name: getattr(args, name) for name in (*same, "block_size")}
    return dict(
        options,
        request_timeout_s=args.request_timeout,
        warmup=not args.no_warmup,
        startup_delay_s=args.startup_delay,
        log_prompts=args.log_prompts,
        console=console,
    )


def base_url(args: argparse.Namespace) -> str:
    """``http://host:port``, or ``https://`` with ``--ssl-certfile``: where clients reach the server."""
    return f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}"


def adapted(args: argparse.Namespace) -> str:
    """The banner's `` + adapter FOLDER`` (``s`` for several), or "" without ``--adapter``."""
    return f" + adapter{'s' * (len(args.adapters) > 1)} {', '.join(args.adapters)}" if args.adapters else ""
