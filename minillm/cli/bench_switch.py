"""``minillm bench --models A,B --pattern alternate|sticky``: what switching models costs a client.

One request at a time, so nothing but the switch separates the two patterns::

    alternate   A B A B ...      every request names the other model (under a one-model budget: a load each)
    sticky      A A ... B B ...  half the requests on A, then half on B (one switch at most)

Reported per pattern: TTFT p50 / p99 at the client (seconds), and, from a minillm server's
``/metrics``, how many loads on demand (``minillm_model_switches_total``) and evictions it made.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from minillm.cli.bench import auth_headers, calibrate_words, make_prompt, one_request, percentiles, save_results

PATTERNS = ("alternate", "sticky")


def order(models: list[str], pattern: str, n: int) -> list[str]:
    """The model of each of ``n`` requests: ``alternate`` cycles, ``sticky`` runs each model in one block.

    Raises:
        ValueError: an unknown pattern.
    """
    if pattern == "alternate":
        return [models[i % len(models)] for i in range(n)]
    if pattern == "sticky":
        per = -(-n // len(models))
        return [m for m in models for _ in range(per)][:n]
    raise ValueError(f"--pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")


async def _counters(http, url: str) -> dict[str, float]:
    """Switches and evictions from a minillm server's /metrics ({} from another server)."""
    try:
        r = await http.get(url + "/metrics")
    except Exception:  # noqa: BLE001 - not every server has /metrics: the client's numbers still stand
        return {}
    if r.status_code != 200:  # none, or not for this key: the client's numbers still stand
        return {}
    text = r.text
    out = {"switches": 0.0, "evictions": 0.0}
    for line in text.splitlines():
        for key, name in (("switches", "minillm_model_switches_total"), ("evictions", "minillm_model_evictions_total")):
            if line.startswith(name):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


async def switch_bench(
    url: str,
    models: list[str],
    patterns: list[str],
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    timeout_s=300,
    api_key: str | None = None,
) -> dict:
    """Run each pattern's ``requests`` requests one after another; returns JSON-ready results (seconds).
    ``api_key``: sent as ``Authorization: Bearer`` on every request, /metrics included (``bench.auth_headers``).

    Raises:
        RuntimeError: a calibration probe failed (server down, unknown model).
    """
    import httpx

    url = url.rstrip("/")
    async with httpx.AsyncClient(timeout=timeout_s, headers=auth_headers(api_key)) as http:
        words = {m: (await calibrate_words(http, url, m, prompt_tokens))[0] for m in models}
        results, index = [], 1
        for pattern in patterns:
            before = await _counters(http, url)
            t0, records = time.perf_counter(), []
            for model in order(models, pattern, requests):
                rec = await one_request(http, url, model, make_prompt(words[model], index), max_tokens)
                records.append({"model": model, **rec.__dict__})
                index += 1
            after = await _counters(http, url)
            results.append(
                {
                    "pattern": pattern,
                    "requests": requests,
                    "ok": sum(r["ok"] for r in records),
                    "wall_s": time.perf_counter() - t0,
                    "ttft_s": percentiles([r["ttft_s"] for r in records if r["ttft_s"] is not None]),
                    "switches": after.get("switches", 0) - before.get("switches", 0) if after else None,
                    "evictions": after.get("evictions", 0) - before.get("evictions", 0) if after else None,
                    "per_request": records,
                }
            )
    return {"url": url, "models": models, "max_tokens": max_tokens, "patterns": results}


def switch_table(results: dict):
    """A rich Table: one row per pattern, TTFT in ms, the server's switches and evictions."""
    from rich.table import Table

    table = Table(title=f"bench {results['url']}  models {', '.join(results['models'])}", title_justify="left")
    for col in ("pattern", "ok", "TTFT p50 ms", "TTFT p99 ms", "switches", "evictions"):
        table.add_column(col, justify="right")
    for p in results["patterns"]:
        t = p["ttft_s"]
        ms = [("-" if t[k] is None else f"{t[k] * 1e3:.1f}") for k in ("p50", "p99")]
        table.add_row(p["pattern"], f"{p['ok']}/{p['requests']}", *ms, str(p["switches"]), str(p["evictions"]))
    return table


def run_switch_command(args: argparse.Namespace) -> int:
    """``minillm bench --models A,B --pattern ...``: table and JSON; exit 2 on bad flags, 1 if a request failed."""
    from rich.console import Console

    console, err = Console(highlight=False), Console(stderr=True)
    models = [m for m in args.models.split(",") if m]
    patterns = [p for p in args.pattern.split(",") if p]
    if len(models) < 2 or any(p not in PATTERNS for p in patterns) or args.requests < 1:
        err.print(f"[bold red]error:[/] --models needs two names or more (got {args.models!r}); --pattern takes "
                  f"{' and/or '.join(PATTERNS)} (got {args.pattern!r}); --requests >= 1")  # fmt: skip
        return 2
    try:
        results = asyncio.run(
            switch_bench(
                args.url,
                models,
                patterns,
                args.requests,
                args.prompt_tokens,
                args.max_tokens,
                args.timeout,
                args.api_key,
            )
        )
    except RuntimeError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        return 2
    console.print(switch_table(results))
    console.print(f"results: {save_results(results, args.json, 'bench-switch')}")
    return 1 if any(p["ok"] < p["requests"] for p in results["patterns"]) else 0
