"""The tracked results of ``python -m benchmarks.speed``: one JSON per BLAS kernel and thread count.

    python -m benchmarks.speed --unset-openblas-env --save-results   # results/speed-<kernel>-<n>t.json
    python -m benchmarks.speed_results                                # the README's table from them

``--save-results`` writes the report (the same dict as ``--json``) with a description of the
machine that ran it (:func:`describe_machine`: CPU model, cores, caches, the BLAS library and the
kernel it ran, threads, the OPENBLAS_* variables the workers saw) to :func:`results_path`, named by
the BLAS kernel the minillm worker reported and the thread count. A plain run's default output stays
the untracked ``benchmarks/results/local/speed.json``. :func:`table` makes the README's table from
the tracked files (``tests/test_speed_results.py`` checks that the README holds what it makes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
#: The README's table starts after this line and ends at the first blank line after it.
TABLE_MARK = "<!-- speed table: python -m benchmarks.speed_results -->"


def cpu_caches(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> list[dict]:
    """CPU 0's caches as Linux lists them: ``[{level, type, size, shared_cpu_list}]`` (empty elsewhere)."""
    caches = []
    for index in sorted(root.glob("index*")):
        try:
            entry = {k: (index / k).read_text().strip() for k in ("level", "type", "size", "shared_cpu_list")}
        except OSError:
            continue
        caches.append(entry)
    return caches


def blas_of(report: dict, worker: str = "minillm") -> dict:
    """The BLAS pool (threadpoolctl's ``user_api == "blas"``) of a worker of the report: ``{}`` if none."""
    for facts in report.get("workers", []):
        if facts.get("worker") == worker:
            pools = [p for p in facts.get("blas") or [] if p.get("user_api") == "blas"]
            return pools[0] if pools else {}
    return {}


def describe_machine(report: dict) -> dict:
    """What ran the report: CPU model, cores, caches, BLAS (library, version, kernel, threads), OPENBLAS_* env."""
    blas = blas_of(report)
    env = next((f.get("env") for f in report.get("workers", []) if f.get("worker") == "minillm"), None)
    return {
        "cpu": report.get("host", {}).get("cpu"),
        "cores": report.get("host", {}).get("cores"),
        "caches": cpu_caches(),
        "blas": {k: blas.get(k) for k in ("internal_api", "version", "architecture", "num_threads")},
        "threads": report.get("settings", {}).get("threads"),
        "openblas_env": env,
    }


def results_path(report: dict, folder: Path = RESULTS) -> Path:
    """``speed-<kernel>-<threads>t.json`` under ``folder``: the minillm worker's BLAS kernel, the run's threads."""
    kernel = blas_of(report).get("architecture") or "unknown"
    return folder / f"speed-{kernel}-{report['settings']['threads']}t.json"


def save(report: dict, folder: Path = RESULTS) -> Path:
    """Write ``report`` with its ``machine_description`` to :func:`results_path`; return the path."""
    path = results_path(report, folder)
    path.write_text(json.dumps({**report, "machine_description": describe_machine(report)}, indent=1))
    return path


def tracked(folder: Path = RESULTS) -> list[dict]:
    """Every saved report in ``folder`` (``speed-*.json``), by file name."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("speed-*.json"))]


def _num(value, spec: str, unit: str = "") -> str:
    return "—" if value is None else f"{format(value, spec)}{unit}"


def row(report: dict) -> str:
    """One table row: BLAS kernel, threads, the figures, the issues' ratios, the load it ran under."""
    d = report["machine_description"]
    figs, ratios = report["figures"], report["ratios"]
    mine, plain = figs.get("minillm", {}), figs.get("minillm-plain", {})
    sdpa = ratios.get("minillm/torch-sdpa", {}).get("prefill_tokens_per_s", {}).get("512")
    eager = ratios.get("minillm/torch-eager", {}).get("decode_tokens_per_s")
    products = ratios.get("minillm/weights-pass", {}).get("decode_tokens_per_s")
    gemm = ratios.get("minillm/ceiling", {}).get("prefill_tokens_per_s", {}).get("512")
    load = report["host"]["loadavg_before"][0]
    cells = [
        f"{d['blas']['architecture']} ({d['blas']['internal_api']} {d['blas']['version']})",
        str(d["threads"]),
        _num(mine.get("prefill_tokens_per_s", {}).get("512"), ",.0f"),
        _num(plain.get("prefill_tokens_per_s", {}).get("512"), ",.0f"),
        _num(sdpa, ".2f", "×"),
        _num(gemm, ".0%"),
        _num(mine.get("decode_tokens_per_s"), ".1f"),
        _num(plain.get("decode_tokens_per_s"), ".1f"),
        _num(eager, ".2f", "×"),
        _num(products, ".0%"),
        f"{load:.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| BLAS kernel | threads | prefill 512 tok/s | plain | ÷ torch sdpa | of GEMM ceiling "
    "| decode tok/s | plain | ÷ torch eager | of products alone | load avg |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def table(reports: list[dict]) -> str:
    """The README's table (markdown) from saved reports, one row each."""
    return "\n".join([HEADER, *(row(r) for r in reports)])


def readme_table(readme: str) -> str:
    """The table in the README's text: the lines after :data:`TABLE_MARK` up to the first blank one."""
    after = readme.split(TABLE_MARK, 1)[1].lstrip("\n")
    return after.split("\n\n", 1)[0].rstrip("\n")


if __name__ == "__main__":
    print(table(tracked()))
    sys.exit(0)
