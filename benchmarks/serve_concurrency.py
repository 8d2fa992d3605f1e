"""``minillm bench`` against ``minillm serve``: output tokens/s at concurrency 8 against concurrency 1.

    python -m benchmarks.serve_concurrency                      # 1 BLAS thread, 3 rounds of (1, 8)
    python -m benchmarks.serve_concurrency --threads 2 --rounds 2
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m benchmarks.serve_concurrency   # OpenBLAS's own kernel

It starts ``minillm serve`` (``--threads``, quiet) on a free port, then runs ``minillm bench``'s
own load generator (``minillm/cli/bench.py``: ``--requests`` streamed completions per level, prompts of
about ``--prompt-tokens`` tokens, ``--max-tokens`` each) at concurrency 1 and 8 in alternation,
``--rounds`` times, so the two levels meet the same minutes of a shared machine. The ratio of
issue 16 is the median over rounds of ``output tokens/s at 8 / output tokens/s at 1`` (target >= 2.5).

Every level is printed with the share of the two cores that *other* processes used meanwhile:
the machine's busy time minus this process's and the server's (``/proc``). The BLAS kernel is
fixed by the environment (``OPENBLAS_CORETYPE``): threadpoolctl reports it from a child process
with the server's environment. Results go to ``benchmarks/results/local/serve_concurrency.json`` (untracked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.server_process import free_port, stop

DEFAULT_JSON = Path(__file__).parent / "results" / "local" / "serve_concurrency.json"
TARGET = 2.5


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _kernel(env: dict) -> str:
    code = (
        "import numpy, threadpoolctl; i = [b for b in threadpoolctl.threadpool_info() if b['user_api'] == 'blas'];"
        "print(i[0].get('architecture') if i else '?')"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip()


def main(argv=None) -> dict:
    from minillm.cli import bench
    from minillm.observe.metrics import cpu_snapshot

    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_concurrency", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)

    port = free_port()
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(args.threads)}
    kernel = _kernel(env)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minillm.cli",
            "serve",
            args.model,
            "--port",
            str(port),
            "--threads",
            str(args.threads),
            "--verbosity",
            "quiet",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        for _ in range(120):  # load + warm-up
            try:
                if httpx.get(url + "/health", timeout=1).json().get("status") == "ready":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        print(
            f"  server: BLAS kernel {kernel}, {args.threads} thread(s); {args.requests} requests per level, "
            f"prompt ~{args.prompt_tokens} tokens, {args.max_tokens} new tokens each",
            flush=True,
        )
        levels = asyncio.run(_levels(bench, url, args, server.pid, cpu_snapshot))
    finally:
        stop(server, timeout=30)
    pairs = zip(levels[::2], levels[1::2], strict=True)  # (concurrency 1, concurrency 8) per round
    ratios = [b["output_tokens_per_s"] / a["output_tokens_per_s"] for a, b in pairs]
    ratio = statistics.median(ratios)
    print(
        f"  output tokens/s, concurrency 8 / 1: {', '.join(f'{x:.2f}' for x in ratios)} -> median {ratio:.2f} "
        f"(target >= {TARGET}): {'pass' if ratio >= TARGET else 'FAIL'}"
    )
    report = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "kernel": kernel,
        "levels": levels,
        "ratios": ratios,
        "ratio": ratio,
        "target": TARGET,
        "load_average": os.getloadavg(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=str))
    return report


async def _levels(bench, url: str, args, server_pid: int, cpu_snapshot) -> list[dict]:
    """Concurrency 1 then 8, ``args.rounds`` times; every request has its own number (a new prompt:
    the server's prefix cache never answers from an earlier round)."""
    import httpx

    levels, index = [], 1
    async with httpx.AsyncClient(timeout=300.0) as http:
        words, _ = await bench.calibrate_words(http, url, args.model, args.prompt_tokens)
        for r in range(args.rounds):
            for c in (1, 8):
                before, server_before = cpu_snapshot(), _cpu_seconds(server_pid)
                level = await bench.run_level(
                    http, url, args.model, c, args.requests, words, args.max_tokens, first_index=index
                )
                index += args.requests
                after, server_after = cpu_snapshot(), _cpu_seconds(server_pid)
                wall, busy = after[0] - before[0], after[1] - before[1]
                ours = (after[2] - before[2]) + (server_after - server_before)
                others = max(0.0, busy - ours) / wall  # cores other processes kept busy
                level |= {"round": r, "others_cores": others}
                levels.append(level)
                print(
                    f"  round {r} concurrency {c}: {level['output_tokens_per_s']:6.1f} output tokens/s, TPOT p50 "
                    f"{level['tpot_s']['p50'] * 1e3:6.1f} ms, TTFT p50 {level['ttft_s']['p50'] * 1e3:7.1f} ms "
                    f"[others kept {others:.2f} cores busy]",
                    flush=True,
                )
    return levels


if __name__ == "__main__":
    main()
