"""benchmarks/speed_results.py: the tracked speed results and the README table made from them."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import speed_results

ROOT = Path(__file__).resolve().parent.parent


def fake_report(kernel="SkylakeX", threads=2):
    return {
        "settings": {"threads": threads},
        "host": {"cpu": "Some CPU", "cores": 2, "loadavg_before": [1.25, 1.0, 1.0]},
        "workers": [
            {"worker": "machine", "blas": [{"user_api": "blas", "architecture": "Other"}], "env": {}},
            {"worker": "minillm", "env": {"OPENBLAS_CORETYPE": None},
             "blas": [{"user_api": "openmp", "architecture": None},
                      {"user_api": "blas", "internal_api": "openblas", "version": "0.3.31", "architecture": kernel,
                       "num_threads": threads}]},
        ],
        "figures": {"minillm": {"prefill_tokens_per_s": {"512": 1060.4}, "decode_tokens_per_s": 69.94},
                    "minillm-plain": {"prefill_tokens_per_s": {"512": 990.0}, "decode_tokens_per_s": 60.0}},
        "ratios": {"minillm/torch-sdpa": {"prefill_tokens_per_s": {"512": 0.855}},
                   "minillm/torch-eager": {"decode_tokens_per_s": 2.761},
                   "minillm/weights-pass": {"decode_tokens_per_s": 0.9049},
                   "minillm/ceiling": {"prefill_tokens_per_s": {"512": 0.634}}},
    }


def test_a_saved_report_is_named_by_the_minillm_workers_blas_kernel_and_threads(tmp_path):
    report = fake_report("Haswell", 1)
    path = speed_results.save(report, tmp_path)
    assert path == tmp_path / "speed-Haswell-1t.json"
    saved = json.loads(path.read_text())
    d = saved["machine_description"]
    assert d["blas"] == {"internal_api": "openblas", "version": "0.3.31", "architecture": "Haswell", "num_threads": 1}
    assert (d["cpu"], d["cores"], d["threads"], d["openblas_env"]) == ("Some CPU", 2, 1, {"OPENBLAS_CORETYPE": None})
    assert isinstance(d["caches"], list)
    assert speed_results.tracked(tmp_path) == [saved]


def test_a_table_row_holds_the_figures_and_ratios():
    report = {**fake_report(), "machine_description": speed_results.describe_machine(fake_report())}
    assert speed_results.row(report) == (
        "| SkylakeX (openblas 0.3.31) | 2 | 1,060 | 990 | 0.85× | 63% | 69.9 | 60.0 | 2.76× | 90% | 1.2 |"
    )
    assert speed_results.table([report]).splitlines()[2] == speed_results.row(report)


def test_the_cpu_caches_are_read_from_sysfs(tmp_path):
    for i, (level, kind, size) in enumerate([("1", "Data", "48K"), ("2", "Unified", "1024K")]):
        (tmp_path / f"index{i}").mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", "0")):
            (tmp_path / f"index{i}" / name).write_text(value + "\n")
    assert speed_results.cpu_caches(tmp_path) == [
        {"level": "1", "type": "Data", "size": "48K", "shared_cpu_list": "0"},
        {"level": "2", "type": "Unified", "size": "1024K", "shared_cpu_list": "0"},
    ]


def test_the_readme_table_is_the_one_made_from_the_tracked_results():
    reports = speed_results.tracked()
    assert reports, "benchmarks/results/ holds no speed-*.json"
    for report in reports:
        assert speed_results.results_path(report).exists()  # each file is named by what it holds
    readme = (ROOT / "README.md").read_text()
    assert speed_results.readme_table(readme) == speed_results.table(reports)
