"""``minillm run`` / ``minillm chat`` with a prompt: one traced request, its attachment, Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from rich.console import Console

from minillm.cli.options import constraint_of


def read_attachment(path: str) -> tuple[str, str]:
    """``(name, text)`` of ``--file PATH`` (``-``: stdin), UTF-8.

    Raises:
        InvalidRequestError: a missing or unreadable file, not UTF-8 text, or an empty one.
    """
    from pathlib import Path

    from minillm.errors import InvalidRequestError

    try:
        if path == "-":
            name, text = "stdin", sys.stdin.buffer.read().decode("utf-8")
        else:
            name, text = Path(path).name, Path(path).expanduser().read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise InvalidRequestError(f"--file {path}: no such file; check the path.") from None
    except IsADirectoryError:
        raise InvalidRequestError(f"--file {path} is a folder; give a text file.") from None
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"--file {path} is not UTF-8 text (byte {exc.start}); attach a text file, or convert it to UTF-8."
        ) from None
    except OSError as exc:
        raise InvalidRequestError(f"--file {path}: cannot read it ({exc.strerror}).") from None
    if not text.strip():
        raise InvalidRequestError(f"--file {path} is empty; attach a file with some text.")
    return name, text


def with_attachment(prompt: str, text: str) -> str:
    """The user message: the attached text, a blank line, then the instruction. Instruction last:
    SmolLM2-135M then summarizes; given the instruction first, it copied the document out."""
    return f"{text.strip()}\n\n{prompt}"


def check_request_args(args: argparse.Namespace) -> None:
    """Refuse what would fail later, before the model loads (errors name the fix)."""
    from pathlib import Path

    from minillm.errors import InvalidRequestError

    if args.prompt is not None and not args.prompt:  # None: a conversation (minillm chat)
        raise InvalidRequestError("the prompt is empty; give at least one character.")
    if args.trace_json:
        folder = Path(args.trace_json).expanduser().resolve().parent
        if not folder.is_dir():
            raise InvalidRequestError(
                f"--trace-json {args.trace_json}: folder {folder} does not exist; create it or give another path."
            )
    if args.threads is not None and args.threads < 1:
        raise InvalidRequestError(f"--threads must be >= 1, got {args.threads}.")


def no_chat_template(name: str, typed: str | None):
    """The ChatTemplateError of ``minillm chat`` on a base model ``name`` (``typed``: as given to -m)."""
    from minillm.errors import ChatTemplateError

    return ChatTemplateError(
        f"{name} has no chat template (a base model: it continues text, it does not answer "
        f'messages); use `minillm run -m {typed or name} "..."` to complete a prompt instead.'
    )


def refuse_base_model(name: str | None) -> None:
    """``minillm chat`` on a manifest model without a chat template: refused before anything is fetched.

    Raises:
        ChatTemplateError: the manifest says the model has none (``chat_template = false``).
    """
    from minillm.errors import ModelNotFoundError
    from minillm.sources.manifest import default_model_name, get_entry

    try:
        entry = get_entry(name or default_model_name())
    except ModelNotFoundError:
        return  # a folder or a hub repo id: its tokenizer says, once loaded
    if not entry.chat_template:
        raise no_chat_template(entry.name, name)


def load_for(args: argparse.Namespace, tracer):
    """The model of a ``run`` / ``chat`` command, loaded with its options (a base model refused for chat)."""
    import minillm

    if args.command == "chat":
        refuse_base_model(args.model)
    model = minillm.load(
        args.model,
        tracer=tracer,
        warmup=not args.no_warmup,
        adapters=args.adapter,
        merge_adapters=args.adapter_mode == "merged",
        threads=args.threads,
        weight_dtype=args.weight_dtype,
        kernels=args.kernels,
        units=args.units,
    )
    if args.command == "chat" and not model.tokenizer.chat_template:
        raise no_chat_template(model.name, args.model)
    return model


def run_request(args: argparse.Namespace, console: Console) -> int:
    import minillm  # the public API: load, stream
    from minillm.observe.events import Tracer
    from minillm.runtime.sampling import SamplingParams
    from minillm.runtime.stopping import StopReason

    check_request_args(args)
    params = SamplingParams.from_fields(args)
    constraint = constraint_of(args)  # a schema that is not JSON is refused before the model loads

    attachment = read_attachment(args.file) if args.file else None
    tracer = Tracer(console if args.trace == "rich" else None, verbosity=args.verbosity or "steps")
    model = load_for(args, tracer)
    user_text = args.prompt
    if attachment is not None:
        name, text = attachment
        user_text = with_attachment(args.prompt, text)
        n = len(model.tokenizer.encode(text.strip(), add_special_tokens=False))
        tracer.emit("attach", tracer.now(), 0.0, name=name, chars=len(text), tokens=n)
    if args.command == "chat":
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt: str | list = messages + [{"role": "user", "content": user_text}]
    else:
        prompt = user_text
    # Ctrl-C sets the cancel event; the request checks it between steps and ends cleanly.
    cancel = threading.Event()

    def on_sigint(signum, frame):
        cancel.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts at once

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if in_main else None
    results: list = []
    try:
        for delta in minillm.stream(
            model,
            prompt,
            params,
            max_new_tokens=args.max_new_tokens,
            chat=args.command == "chat",
            tracer=tracer,
            stop=args.stop,
            stop_token_ids=args.stop_token_ids,
            include_stop_string=args.include_stop_string,
            cancel=cancel,
            timeout_s=args.timeout,
            max_seq_len=args.max_seq_len,
            result=results,
            kv_dtype=args.kv_dtype,
            speculative=minillm.Speculative(draft=args.speculative, num_tokens=args.num_speculative_tokens)
            if args.speculative
            else None,
            constraint=constraint,
        ):
            if args.verbosity == "quiet":  # only the text, as it arrives
                sys.stdout.write(delta)
                sys.stdout.flush()
    finally:
        if in_main:
            signal.signal(signal.SIGINT, previous)
    result = results[0]
    if args.verbosity == "quiet":
        sys.stdout.write("\n")
    if result.logprobs is not None:  # on stderr when stdout carries the trace's JSON lines
        print_logprobs(console if args.trace != "json" else Console(stderr=True), model.tokenizer, result.logprobs)
    if args.trace == "json":
        sys.stdout.write(tracer.to_jsonl())
    if args.trace_json:
        with open(args.trace_json, "w", encoding="utf-8") as f:
            f.write(tracer.to_jsonl())
    if result.stop_reason is StopReason.CANCELLED:
        Console(stderr=True).print(
            f"[yellow]cancelled[/] by Ctrl-C after {len(result.ids)} new token{'' if len(result.ids) == 1 else 's'}; "
            "the partial output is above"
        )
        return 130
    return 0


def print_logprobs(console: Console, tokenizer, logprobs: list[dict]) -> None:
    """``--top-logprobs N``: one row per new token, its log-probability (natural log, the model's own
    before any processor, as OpenAI's ``logprobs``), its log-probability in the distribution it was drawn
    from (``sampled``: after the bias, penalties, temperature, top-k, top-p, min-p) and the N most likely
    alternatives (the model's)."""
    from rich.table import Table

    def piece(i: int) -> str:
        return repr(tokenizer.decode([i]))

    table = Table(title="logprobs", box=None, padding=(0, 1))
    for column, justify in (("step", "right"), ("token", "left"), ("id", "right"), ("logprob", "right"),
                            ("sampled", "right")):  # fmt: skip
        table.add_column(column, justify=justify)
    table.add_column("alternatives (logprob)")
    for step, lp in enumerate(logprobs):
        top = ", ".join(f"{piece(i)} {v:.3f}" for i, v in lp["top"])
        numbers = f"{lp['logprob']:.4f}", f"{lp['sampled_logprob']:.4f}"
        table.add_row(str(step), piece(lp["id"]), str(lp["id"]), *numbers, top)
    console.print(table)
