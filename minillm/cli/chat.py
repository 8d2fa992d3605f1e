"""``minillm chat`` with no prompt: a conversation on the terminal.

    $ minillm chat
    > What is the capital of France?
    The capital of France is Paris.
    > And of Italy?
    ...

Each line is a user turn; the history goes through the chat template and the KV cache is kept
between turns (``minillm.Conversation``: a turn prefills only its new tokens). Ctrl-D (end of
input) leaves; Ctrl-C stops the answer in progress, a second Ctrl-C leaves. Only the answers are
printed unless ``-v`` asks for a trace of every turn.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import TextIO

from rich.console import Console

PROMPT = "> "


def converse(conversation, params, options: dict, *, stdin: TextIO, stdout: TextIO, tracer=None, cancel=None) -> list:
    """Read user turns from ``stdin`` until end of input; write each answer to ``stdout``.

    Args:
        conversation: a :class:`minillm.Conversation`; options: request options for every turn
            (``max_new_tokens``, ``stop`` ...); tracer: told every turn's phases (it prints them:
            the answer is then not written again); cancel: a ``threading.Event`` that ends the
            answer in progress (cleared before each turn).

    Returns:
        the :class:`GenerationResult` of every turn, in order.

    Raises:
        MiniLLMError: what a turn raises (e.g. ContextWindowExceeded once the conversation fills the cache).
    """
    results: list = []
    while True:
        stdout.write(PROMPT)
        stdout.flush()
        line = stdin.readline()
        if not line:  # end of input: Ctrl-D on a terminal
            stdout.write("\n")
            return results
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        if cancel is not None:
            cancel.clear()
        done: list = []
        for delta in conversation.stream(text, params, tracer=tracer, result=done, cancel=cancel, **options):
            if tracer is None:
                stdout.write(delta)
                stdout.flush()
        stdout.write("\n")
        results.append(done[0])


def run_conversation(args: argparse.Namespace, console: Console) -> int:
    """``minillm chat`` without a prompt: load, then :func:`converse` on the terminal; returns the exit status.

    Raises:
        InvalidRequestError: ``--file`` without a prompt (an attachment goes with one message).
        ChatTemplateError: a base model (refused before anything is fetched when the manifest knows it).
    """
    import minillm
    from minillm.cli.request import check_request_args, load_for
    from minillm.errors import InvalidRequestError
    from minillm.observe.events import Tracer
    from minillm.runtime.sampling import SamplingParams

    check_request_args(args)
    if args.file:
        raise InvalidRequestError(
            "--file attaches a document to one message; give the prompt too (chat --file F PROMPT)."
        )
    params = SamplingParams.from_fields(args)
    tracer = Tracer(console, verbosity=args.verbosity) if args.verbosity not in (None, "quiet") else None
    model = load_for(args, tracer)
    conversation = minillm.Conversation(model, system=args.system, max_seq_len=args.max_seq_len, kv_dtype=args.kv_dtype)
    options = dict(
        max_new_tokens=args.max_new_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        include_stop_string=args.include_stop_string,
        timeout_s=args.timeout,
    )
    if sys.stdin.isatty():
        console.print(f"[bold]{model.name}[/]: a conversation (the KV cache is kept between turns); Ctrl-D leaves")
    cancel = threading.Event()

    def on_sigint(signum, frame):
        if cancel.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C leaves
        cancel.set()

    previous = (
        signal.signal(signal.SIGINT, on_sigint) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        converse(conversation, params, options, stdin=sys.stdin, stdout=sys.stdout, tracer=tracer, cancel=cancel)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return 0
