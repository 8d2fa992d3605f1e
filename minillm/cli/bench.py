"""``minillm bench``: a load generator that measures a server the way its clients feel it.

It speaks only OpenAI's API (``POST /v1/completions`` with ``stream: true`` and
``stream_options.include_usage``), so it measures vLLM or llama.cpp's server exactly as it
measures ``minillm serve``. For each concurrency level C it keeps C requests in flight until
``requests`` have finished, and records per request, at the client (seconds):

    TTFT   send -> first chunk with text            (queue wait + prefill + network)
    ITL    gaps between chunks with text            (inter-token latency, one per gap)
    TPOT   (end - first text) / (output tokens - 1) (mean time per output token after the first)
    e2e    send -> last byte

and per level: p50 / p90 / p99 of each, requests/s and output tokens/s over the level's wall time.

Prompts are about ``prompt_tokens`` long, cut from a fixed text; the length is calibrated on
the server itself (one probe request reads ``usage.prompt_tokens``), never with a local tokenizer,
so the numbers mean the same for any server. Token counts come from the server's ``usage``; if a
server sends no usage in its stream, the chunks with text are counted instead (the JSON says so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

# A fixed, plain text (written for minillm) that prompts are cut from; each request's prompt starts
# with its own number, so a server with a prefix cache cannot answer from a previous request's work.
FIXED_TEXT = (
    "The harbour town woke before the sun. Fishing boats slid out past the breakwater while the baker "
    "pulled the first loaves from a stone oven and the gulls argued over the scraps on the quay. By seven "
    "the market square was full of voices: a woman selling lemons from a wooden cart, two old men playing "
    "chess beneath the clock tower, a boy delivering newspapers on a bicycle with a squeaking wheel. The "
    "ferry to the islands left at eight, carrying tourists with cameras, workers with tool bags and a "
    "teacher taking her class to see the lighthouse. In the afternoon the wind turned, the sea grew grey, "
    "and the boats came home early with half-empty nets and stories about the storm that never arrived. "
)


@dataclass(kw_only=True)
class RequestRecord:
    """One request as the client saw it (seconds, tokens)."""

    ok: bool
    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_from_server: bool = False
    error: str | None = None


def make_prompt(n_words: int, index: int) -> str:
    """About ``n_words`` words of FIXED_TEXT, repeated as needed, starting with the request's number."""
    words = FIXED_TEXT.split()
    body = " ".join(words[i % len(words)] for i in range(max(1, n_words)))
    return f"Request {index}. {body}"


async def calibrate_words(http, url: str, model: str, prompt_tokens: int) -> tuple[int, int]:
    """How many words of FIXED_TEXT make ``prompt_tokens`` tokens on this server (two probes).

    Returns:
        (words, tokens the server counted for them). Raises RuntimeError if no server answers at
        ``url`` or the server refuses.
    """
    words = max(1, round(prompt_tokens / 1.3))  # first guess: ~1.3 tokens per English word
    for _ in range(2):  # the second probe corrects the guess with the measured ratio
        r = await _probe(http, url, model, words)
        if r.status_code != 200:
            raise RuntimeError(f"calibration request failed: {r.status_code} {r.text[:300]}")
        tokens = r.json()["usage"]["prompt_tokens"]
        words = max(1, round(words * prompt_tokens / tokens))
    r = await _probe(http, url, model, words)
    return words, r.json()["usage"]["prompt_tokens"]


async def _probe(http, url: str, model: str, words: int):
    """One completion of one token; a server that cannot be reached is a RuntimeError naming ``url``."""
    import httpx

    try:
        return await http.post(
            url + "/v1/completions",
            json={"model": model, "prompt": make_prompt(words, 0), "max_tokens": 1, "temperature": 0},
        )
    except httpx.TransportError as exc:  # refused, unknown host, timed out: the first request finds it
        why = str(exc) or type(exc).__name__
        raise RuntimeError(
            f"no server answers at {url} ({why}); start one (`minillm serve`) or pass its address with --url"
        ) from None


async def one_request(http, url: str, model: str, prompt: str, max_tokens: int) -> RequestRecord:
    """Send one streaming completion and time it at the client."""
    import httpx

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage = None
    for attempt in (1, 2):
        answered = False
        try:
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                answered = True
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    return RequestRecord(ok=False, status=r.status_code, error=text[:300])
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if any(c.get("text") for c in chunk.get("choices") or []):
                        stamps.append(time.perf_counter())
                    if chunk.get("usage"):
                        usage = chunk["usage"]
            break
        except Exception as exc:  # noqa: BLE001 - a failed request is a result to report, not a crash
            # A server may close a kept-alive connection after a streamed answer without saying so
            # (llama.cpp's does): a request sent on it meets the close before any answer, unread.
            # It is sent once more (the pool drops the closed connection), as the openai client retries.
            if attempt == 2 or answered or not isinstance(exc, httpx.RemoteProtocolError):
                return RequestRecord(ok=False, status=0, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    n_out = usage["completion_tokens"] if usage else len(stamps)
    rec = RequestRecord(
        ok=True,
        status=200,
        e2e_s=end - t0,
        prompt_tokens=usage["prompt_tokens"] if usage else None,
        completion_tokens=n_out,
        usage_from_server=usage is not None,
    )
    if stamps:
        rec.ttft_s = stamps[0] - t0
        rec.itl_s = np.diff(stamps).tolist()
        if n_out > 1:
            rec.tpot_s = (end - stamps[0]) / (n_out - 1)
    return rec


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 and mean of ``values`` (seconds); None when empty."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values, dtype=np.float64)
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
    }


async def run_level(
    http,
    url: str,
    model: str,
    concurrency: int,
    n_requests: int,
    n_words: int,
    max_tokens: int,
    on_done=None,
    first_index: int = 1,
) -> dict:
    """Keep ``concurrency`` requests in flight until ``n_requests`` finished; summarise the level."""
    todo = iter(range(first_index, first_index + n_requests))
    records: list[RequestRecord] = []

    async def client() -> None:
        for index in todo:  # clients share one iterator: each request is taken exactly once
            records.append(await one_request(http, url, model, make_prompt(n_words, index), max_tokens))
            if on_done:
                on_done()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    return {
        "concurrency": concurrency,
        "requests": n_requests,
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "error_samples": [f"{r.status} {r.error}" for r in records if not r.ok][:3],
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in ok if r.prompt_tokens is not None] or [0])),
        "completion_tokens_mean": out_tokens / max(1, len(ok)),
        "usage_from_server": all(r.usage_from_server for r in ok),
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": percentiles([g for r in ok for g in r.itl_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
        "per_request": [asdict(r) for r in records],
    }


async def bench(
    url: str,
    model: str,
    concurrency: list[int],
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    timeout_s: float = 300.0,
    progress=None,
    api_key: str | None = None,
) -> dict:
    """Run every concurrency level in turn; returns the results as a JSON-ready dict.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8000`` (``/v1/...`` is appended).
        concurrency: client counts, e.g. ``[1, 2, 4]``; ``requests`` requests per level.
        prompt_tokens: target prompt length in the server's tokens; max_tokens: per request.
        progress: a ``rich.progress.Progress`` to advance, or None.
        api_key: sent as ``Authorization: Bearer`` on every request (a server with keys), or None.

    Raises:
        RuntimeError: the calibration probe failed (server down, wrong model name ...).
    """
    import httpx

    url = url.rstrip("/")
    limits = httpx.Limits(max_connections=max(concurrency) + 2, max_keepalive_connections=max(concurrency) + 2)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=auth_headers(api_key)) as http:
        words, measured = await calibrate_words(http, url, model, prompt_tokens)
        task = progress.add_task("requests", total=requests * len(concurrency)) if progress else None
        levels, index = [], 1
        for c in concurrency:
            if progress:
                progress.update(task, description=f"concurrency {c}")
            levels.append(
                await run_level(
                    http,
                    url,
                    model,
                    c,
                    requests,
                    words,
                    max_tokens,
                    on_done=(lambda: progress.advance(task)) if progress else None,
                    first_index=index,
                )
            )
            index += requests
    return {
        "url": url,
        "model": model,
        "prompt_tokens_target": prompt_tokens,
        "prompt_words": words,
        "prompt_tokens_calibrated": measured,
        "max_tokens": max_tokens,
        "requests_per_level": requests,
        "started": datetime.now().isoformat(timespec="seconds"),
        "levels": levels,
    }


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header a server with keys asks for (``minillm serve --api-key``): ``{}`` without a key; the
    key from ``MINILLM_API_KEY`` when ``api_key`` is None and the variable is set."""
    key = api_key if api_key is not None else os.environ.get("MINILLM_API_KEY", "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def results_table(results: dict):
    """A rich Table: one row per concurrency level, latencies in ms."""
    from rich.table import Table

    def ms(stat: dict, key: str) -> str:
        return "-" if stat[key] is None else f"{stat[key] * 1e3:.1f}"

    table = Table(
        title=f"bench {results['url']}  model {results['model']}  prompt ~{results['prompt_tokens_calibrated']}"
        f" tokens  max_tokens {results['max_tokens']}",
        title_justify="left",
    )
    for col in (
        "conc",
        "ok/err",
        "TTFT p50/p90/p99 ms",
        "TPOT p50/p90 ms",
        "ITL p50/p99 ms",
        "e2e p50/p90/p99 ms",
        "req/s",
        "out tok/s",
    ):
        table.add_column(col, justify="right")
    for lv in results["levels"]:
        t, p, i, e = lv["ttft_s"], lv["tpot_s"], lv["itl_s"], lv["e2e_s"]
        table.add_row(
            str(lv["concurrency"]),
            f"{lv['ok']}/{lv['errors']}",
            f"{ms(t, 'p50')} / {ms(t, 'p90')} / {ms(t, 'p99')}",
            f"{ms(p, 'p50')} / {ms(p, 'p90')}",
            f"{ms(i, 'p50')} / {ms(i, 'p99')}",
            f"{ms(e, 'p50')} / {ms(e, 'p90')} / {ms(e, 'p99')}",
            f"{lv['requests_per_s']:.2f}",
            f"{lv['output_tokens_per_s']:.1f}",
        )
    return table


def save_results(results: dict, path: str | None, kind: str) -> Path:
    """Write a benchmark's results as JSON to ``path``, or to ``bench-results/<kind>-<local time>.json`` (an
    untracked folder) when no path is given; returns the path written. Raises OSError when it cannot write."""
    out = Path(path or f"bench-results/{kind}-{datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    return out


def run_bench_command(args: argparse.Namespace) -> int:
    """``minillm bench``: progress bar, table, JSON file; exit status 1 if any request failed, 2 on bad flags."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console, err = Console(highlight=False), Console(stderr=True)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        err.print(f"[bold red]error:[/] --concurrency expects comma-separated integers, got {args.concurrency!r}")
        return 2
    if min(levels) < 1 or args.requests < 1 or args.prompt_tokens < 1 or args.max_tokens < 1:
        err.print("[bold red]error:[/] --concurrency, --requests, --prompt-tokens and --max-tokens must be >= 1")
        return 2
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=True, disable=not sys.stdout.isatty()) as progress:
            results = asyncio.run(
                bench(
                    args.url,
                    args.model,
                    levels,
                    args.requests,
                    args.prompt_tokens,
                    args.max_tokens,
                    args.timeout,
                    progress,
                    args.api_key,
                )
            )
    except RuntimeError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)  # one line, however wide the terminal
        return 2
    console.print(results_table(results))
    console.print(f"results: {save_results(results, args.json, 'bench')}")
    return 1 if any(lv["errors"] for lv in results["levels"]) else 0
