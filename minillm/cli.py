"""The ``minillm`` command: run a traced request, chat, or list the models it knows.

    minillm run "The capital of France is"          # completion, traced
    minillm chat "What is the capital of France?"   # through the chat template
    minillm chat --file examples/incident.txt "Summarize this incident report in two bullets."
    cat report.txt | minillm chat --file - "Summarize this."   # the attachment from stdin
    minillm models                                  # the manifest
    minillm calibrate                               # measure this machine again (the diagnosis's rates)

Errors minillm raises on purpose (``MiniLLMError``) print as one clear message, no traceback
(``--debug`` shows it), and exit with status 2.

Ctrl-C during a request cancels it cleanly: the step in progress finishes, the partial text and
the trace (stop reason "cancelled") are printed, and the exit status is 130 (the shell's code for
"interrupted by the user"). A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from rich.console import Console
from rich.table import Table

from minillm.errors import MiniLLMError
from minillm.serve import add_commands as add_serve_commands


def _add_request_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument(
        "--model",
        "-m",
        default=None,
        help="a name from `minillm models` or a local model folder (default: the manifest's default)",
    )
    p.add_argument("--max-new-tokens", "-n", type=int, default=48, help="budget of new tokens (default 48)")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same tokens)")
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="stop when TEXT appears in the output, which is cut before it (repeatable; in bash, $'\\n' is a newline)",
    )
    p.add_argument(
        "--stop-token-ids",
        action="append",
        default=None,
        type=_id_list,
        metavar="IDS",
        help="stop when these comma-separated ids appear in a row, e.g. 2 or 28,29 (repeatable)",
    )
    p.add_argument(
        "--include-stop-string",
        action="store_true",
        help="keep the matched stop string (or stop sequence's text) in the output",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="wall-clock deadline for the request; it stops with reason 'timed out'",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        metavar="N",
        help="KV-cache size in positions (default prompt + max new tokens, at most the context); "
        "prompt + new tokens never exceed it (reason 'context full')",
    )
    p.add_argument(
        "--verbosity",
        "-v",
        choices=("quiet", "summary", "steps", "full"),
        default="steps",
        help="how much of the trace to print (default steps)",
    )
    p.add_argument(
        "--trace",
        choices=("rich", "json"),
        default="rich",
        help="rich: the readable trace (default); json: the events as JSON lines on stdout",
    )
    p.add_argument(
        "--trace-json", metavar="PATH", default=None, help="also write the trace events as JSON lines to PATH"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="BLAS threads for the matrix multiplies (threadpoolctl; default: all cores)",
    )
    p.add_argument(
        "--weight-dtype",
        choices=("float32", "bfloat16", "int8", "gguf"),
        default="float32",
        help="how the weight matrices are held in memory: float32; bfloat16; int8 (per-row scales); "
        "gguf (the model's GGUF blocks kept packed, e.g. Q4_1). Norms stay float32; the math is float32",
    )
    p.add_argument(
        "--kernels",
        choices=("tuned", "plain"),
        default="tuned",
        help="the forward's products and attention: tuned (minillm/kernels, default) or plain (minillm/model)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=("float32", "float16", "int8"),
        default="float32",
        help="how the KV cache holds keys and values: float32 (default); float16 (half the bytes); "
        "int8 (+ a float32 scale per position and head). Attention still computes in float32",
    )
    p.add_argument(
        "--adapter",
        action="append",
        default=None,
        metavar="PATH",
        help="a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors); repeatable",
    )
    p.add_argument(
        "--adapter-mode",
        choices=("merged", "unmerged"),
        default="merged",
        help="merged: folded into the weights at load (default, no cost per token); "
        "unmerged: the low-rank path computed in every forward",
    )
    p.add_argument(
        "--no-warmup", action="store_true", help="skip the warm-up request (the first request then pays one-time costs)"
    )
    p.add_argument(
        "--file",
        "-f",
        default=None,
        metavar="PATH",
        help="attach a text file (UTF-8; '-' reads stdin): its text, a blank line, then the prompt "
        "(in chat: the user message)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def _id_list(text: str) -> list[int]:
    """'28,29' -> [28, 29] (argparse type for --stop-token-ids)."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 28,29, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minillm", description="A traced, from-scratch NumPy LLM runtime.")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="complete a prompt (no chat template), with a trace")
    _add_request_args(run)
    chat = sub.add_parser("chat", help="answer a user message through the model's chat template")
    _add_request_args(chat)
    chat.add_argument("--system", default=None, help="an optional system message")
    models = sub.add_parser("models", help="list the models in weights_manifest.toml")
    models.add_argument("--debug", action="store_true")
    add_serve_commands(sub)
    cal = sub.add_parser(
        "calibrate",
        help="measure this machine's rates (bandwidth, GEMM, disk) again; the diagnosis compares each phase with them",
    )
    cal.add_argument("--threads", type=int, default=None, metavar="N", help="BLAS threads to measure with")
    cal.add_argument("--debug", action="store_true")
    return parser


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


def _check_request_args(args: argparse.Namespace) -> None:
    """Refuse what would fail later, before the model loads (errors name the fix)."""
    from pathlib import Path

    from minillm.errors import InvalidRequestError

    if not args.prompt:
        raise InvalidRequestError("the prompt is empty; give at least one character.")
    if args.trace_json:
        folder = Path(args.trace_json).expanduser().resolve().parent
        if not folder.is_dir():
            raise InvalidRequestError(
                f"--trace-json {args.trace_json}: folder {folder} does not exist; create it or give another path."
            )
    if args.threads is not None and args.threads < 1:
        raise InvalidRequestError(f"--threads must be >= 1, got {args.threads}.")


def _cmd_request(args: argparse.Namespace, console: Console) -> int:
    import minillm  # the public API: load, stream
    from minillm.observe.events import Tracer
    from minillm.runtime.sampling import SamplingParams
    from minillm.runtime.stopping import StopReason

    _check_request_args(args)
    params = SamplingParams.from_fields(args)

    attachment = read_attachment(args.file) if args.file else None
    tracer = Tracer(console if args.trace == "rich" else None, verbosity=args.verbosity)
    model = minillm.load(
        args.model,
        tracer=tracer,
        warmup=not args.no_warmup,
        adapters=args.adapter,
        merge_adapters=args.adapter_mode == "merged",
        threads=args.threads,
        weight_dtype=args.weight_dtype,
        kernels=args.kernels,
    )
    user_text = args.prompt
    if attachment is not None:
        name, text = attachment
        user_text = with_attachment(args.prompt, text)
        n = len(model.tokenizer.encode(text.strip(), add_special_tokens=False))
        tracer.emit("attach", tracer.now(), 0.0, name=name, chars=len(text), tokens=n)
    if args.command == "chat":
        if not model.tokenizer.chat_template:
            from minillm.errors import ChatTemplateError

            raise ChatTemplateError(
                f"{model.name} has no chat template (a base model: it continues text, it does not answer "
                f'messages); use `minillm run -m {args.model or model.name} "..."` to complete a prompt instead.'
            )
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
            timeout_s=args.timeout,
            max_seq_len=args.max_seq_len,
            kv_dtype=args.kv_dtype,
            cancel=cancel,
            result=results,
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``minillm`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    console = Console(highlight=False)
    try:
        if args.command == "models":
            return _cmd_models(console)
        if args.command == "calibrate":
            return _cmd_calibrate(args, console)
        if hasattr(args, "run_command"):  # serve, bench (minillm/serve)
            return args.run_command(args)
        return _cmd_request(args, console)
    except MiniLLMError as exc:
        if args.debug:
            raise
        Console(stderr=True).print(f"[bold red]error:[/] {type(exc).__name__}: {exc}", markup=True, highlight=False)
        return 2
    except KeyboardInterrupt:
        Console(stderr=True).print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
