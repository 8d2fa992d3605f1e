"""The options of ``minillm run`` and ``minillm chat``: the request's arguments on the command line."""

from __future__ import annotations

import argparse


def add_request_args(p: argparse.ArgumentParser, *, conversation: bool = False) -> None:
    """The request's options on ``p``; ``conversation``: the prompt may be left out (``minillm chat``:
    a conversation on the terminal)."""
    if conversation:
        p.add_argument(
            "prompt",
            nargs="?",
            default=None,
            help="the user message; none: a conversation on the terminal (Ctrl-D leaves)",
        )
    else:
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
    add_openai_sampling_args(p)
    _add_stop_args(p)
    _add_trace_args(p)
    _add_load_args(p)
    p.add_argument(
        "--file",
        "-f",
        default=None,
        metavar="PATH",
        help="attach a text file (UTF-8; '-' reads stdin): its text, a blank line, then the prompt "
        "(in chat: the user message)",
    )
    p.add_argument("--speculative", default=None, metavar="DRAFT", help="draft: ngram | self-int8 | layers:K")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K", help="drafted per pass (default 4)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def _add_stop_args(p: argparse.ArgumentParser) -> None:
    """When the request stops: stop strings, stop-token sequences, a deadline, the KV cache's size."""
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


VERBOSITY = ("quiet", "summary", "steps", "full")
#: What ``-v`` alone means: the level above the default ``steps``.
BARE_VERBOSITY = "full"


def bare_verbosity(argv: list[str]) -> list[str]:
    """``-v`` (or ``--verbosity``) followed by a word that is no level, e.g. the prompt in
    ``minillm run -v "The capital of France is"``, means -v alone: :data:`BARE_VERBOSITY` is put
    after it, so argparse does not take the prompt for a level. A word close to a level (``-v summry``)
    is left for argparse to refuse, naming the levels. Only ``run`` and ``chat``; nothing after ``--``
    changes."""
    from difflib import get_close_matches

    if not argv or argv[0] not in ("run", "chat"):
        return list(argv)
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        out.append(arg)
        if arg in ("-v", "--verbosity") and i + 1 < len(argv):
            following = argv[i + 1]
            typo = get_close_matches(following.lower(), VERBOSITY, n=1, cutoff=0.6)
            if following not in VERBOSITY and not following.startswith("-") and not typo:
                out.append(BARE_VERBOSITY)
    return out


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    """How much of the request's trace is printed, and where its events go."""
    p.add_argument(
        "--verbosity",
        "-v",
        nargs="?",
        const=BARE_VERBOSITY,
        choices=VERBOSITY,
        default=None,
        help="how much of the trace to print: quiet (the text only), summary, steps (default: compact, a "
        "short request fits one screen), full (+ the config, tokenizer and memory tables, the causal mask, "
        f"every token and step); -v alone means -v {BARE_VERBOSITY}. A conversation on the terminal prints only "
        "the answers unless -v is given",
    )
    p.add_argument("--trace", choices=("rich", "json"), default="rich", help="rich (default), or json: JSON lines")
    p.add_argument(
        "--trace-json", metavar="PATH", default=None, help="also write the trace events as JSON lines to PATH"
    )


def _add_load_args(p: argparse.ArgumentParser) -> None:
    """How the model is loaded and run: threads, weight and KV dtypes, kernels, LoRA adapters, warm-up."""
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
    units = "your exercises folder (minillm exercises start DIR): its started units replace the textbook's"
    p.add_argument("--units", metavar="DIR", help=units + " in the plain kernels; the trace's load section names them")
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


def add_openai_sampling_args(p: argparse.ArgumentParser) -> None:
    """OpenAI's sampling fields (minillm/runtime/sampling.py), and a grammar the output must follow."""
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="minus count x this per generated id")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="minus this once per generated id")
    p.add_argument(
        "--logit-bias",
        action="append",  # default None: no bias
        type=_bias,
        metavar="ID=BIAS",
        help="add BIAS in [-100, 100] to token ID's logit, e.g. 28=-100 bans ',' (repeatable)",
    )
    p.add_argument(
        "--top-logprobs",
        type=int,
        default=None,
        metavar="N",
        help="after the answer, each new token's log-probability and the N (0-20) most likely alternatives",
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument("--json-schema", metavar="JSON|PATH", help="the output is JSON valid against this schema")
    how.add_argument("--regex", metavar="PATTERN", help="the whole output matches PATTERN")
    how.add_argument("--grammar", metavar="LARK|PATH", help="the output follows this Lark-style grammar")


def constraint_of(args: argparse.Namespace):
    """--json-schema / --regex / --grammar -> a Constraint or None (text or a file's path)."""
    import json
    from pathlib import Path

    from minillm.errors import InvalidRequestError
    from minillm.runtime.constraint import Constraint, require_engine

    def text(value: str) -> str:
        path = Path(value).expanduser()
        return path.read_text(encoding="utf-8") if len(value) < 4096 and path.is_file() else value

    given = {"--json-schema": args.json_schema, "--regex": args.regex, "--grammar": args.grammar}
    flag = next((name for name, value in given.items() if value), None)
    if flag is None:
        return None
    require_engine(flag)  # a missing extra is said before the model loads or is fetched
    if args.json_schema:
        try:
            return Constraint.json_schema(json.loads(text(args.json_schema)))
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"--json-schema is neither a file nor JSON ({exc}); give a schema") from None
    if args.regex:
        return Constraint.regex(args.regex)
    return Constraint.lark(text(args.grammar))


def _bias(text: str) -> tuple[int, float]:
    """'28=-100' -> (28, -100.0) (argparse type for --logit-bias)."""
    try:
        token, bias = text.split("=")
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS such as 28=-100, got {text!r}") from None


def _id_list(text: str) -> list[int]:
    """'28,29' -> [28, 29] (argparse type for --stop-token-ids)."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 28,29, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids
