"""Greedy ids of ``generate``, ``generate_batch``, speculative decoding and the server: a refactor's check.

    PYTHONPATH=/path/to/checkout python -m benchmarks.greedy_ids --kernels plain > build/ids_plain.jsonl
    PYTHONPATH=/path/to/checkout python -m benchmarks.greedy_ids --server > build/ids_server.jsonl

Five prompts x ``--tokens`` new tokens (32) on ``--model`` (SmolLM2-135M-Instruct), greedy, one
BLAS thread: ``generate`` one request at a time, ``generate_batch`` all five together (continuous
batching over the paged pool), and each with ``speculative="ngram"`` and ``"layers:8"`` (the
model's own first layers as the draft). ``--server`` instead starts that checkout's ``minillm serve``
(its default kernels) and sends the five prompts at once to ``/v1/completions`` (temperature 0,
``logprobs`` asked for: each new token's text, one per id, as the API has no ids). Run it on two
checkouts (``PYTHONPATH``) and compare the outputs: a change that keeps the numbers prints the same
lines. No timings.
"""

from __future__ import annotations

import argparse
import json

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three uses of a paper clip:",
    "Summarise: the meeting moved to Tuesday at 10 because the room was booked; bring the budget.",
]
DRAFTS = ("ngram", "layers:8")


def greedy_ids(model_name: str, kernels: str, tokens: int) -> dict[str, list[list[int]]]:
    """Every run's new ids per prompt: ``{"generate": [[id, ...] x 5], "generate_batch": ..., ...}``."""
    import minillm

    model = minillm.load(model_name, kernels=kernels, threads=1)
    out: dict[str, list[list[int]]] = {}
    out["generate"] = [list(minillm.generate(model, p, max_new_tokens=tokens).ids) for p in PROMPTS]
    out["generate_batch"] = [list(r.ids) for r in minillm.generate_batch(model, PROMPTS, max_new_tokens=tokens)]
    for draft in DRAFTS:
        out[f"generate speculative={draft}"] = [
            list(minillm.generate(model, p, max_new_tokens=tokens, speculative=draft).ids) for p in PROMPTS
        ]
        batch = minillm.generate_batch(model, PROMPTS, max_new_tokens=tokens, speculative=draft)
        out[f"generate_batch speculative={draft}"] = [list(r.ids) for r in batch]
    return out


def server_ids(model_name: str, tokens: int) -> dict[str, list[list[str]]]:
    """The server's new tokens per prompt (each id's text), the five requests sent together (batched by
    its scheduler)."""
    import os
    import subprocess
    import sys
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import httpx

    from benchmarks.server_process import free_port, ready, stop, wait_for

    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="greedy-ids-")) / "server.log"
    with log.open("w") as out:
        cmd = [sys.executable, "-m", "minillm", "serve", model_name, "--port", str(port)]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url, ready, proc, log, timeout=600)

        def complete(prompt: str) -> list[str]:
            body = {"model": model_name, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "logprobs": 0}
            r = httpx.post(url + "/v1/completions", json=body, timeout=600)
            r.raise_for_status()
            return r.json()["choices"][0]["logprobs"]["tokens"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            return {"server /v1/completions": list(pool.map(complete, PROMPTS))}
    finally:
        stop(proc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--kernels", default="tuned", choices=["plain", "tuned"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--server", action="store_true", help="the server's ids instead (its default kernels)")
    args = parser.parse_args(argv)
    if args.server:
        ids = server_ids(args.model, args.tokens)
    else:
        ids = greedy_ids(args.model, args.kernels, args.tokens)
    kernels = "server" if args.server else args.kernels
    print(json.dumps({"model": args.model, "kernels": kernels, "tokens": args.tokens}))
    for run, rows in ids.items():  # one line per run: a diff of two outputs names the run that differs
        print(json.dumps({run: rows}))


if __name__ == "__main__":
    main()
