"""``minillm chat --file``: the seed's request with its document attached, from a file or stdin;
``minillm chat`` on a base model; ``minillm calibrate``.

Expected values: the file's own bytes (the rendered prompt must contain them verbatim), and token
counts from the ``tokenizers`` library reading the model's tokenizer.json directly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cli_runs import events, run_cli

ROOT = Path(__file__).resolve().parents[2]
INCIDENT = ROOT / "examples" / "incident.txt"
ASK = "Summarize this incident report in two bullets."


@pytest.mark.slow
@pytest.mark.parametrize("source", ["file", "stdin"])
def test_chat_with_an_attached_report_puts_its_text_in_the_user_message(smollm2, tmp_path, source):
    from tokenizers import Tokenizer

    trace = tmp_path / "trace.jsonl"
    text = INCIDENT.read_text(encoding="utf-8")
    where = ["--file", "examples/incident.txt"] if source == "file" else ["--file", "-"]
    proc = run_cli("chat", *where, ASK, "-n", "2", "-v", "quiet", "--trace-json", str(trace),
                   stdin=text if source == "stdin" else None)
    assert proc.returncode == 0, proc.stderr
    e = events(trace)
    assert e["prepare"]["messages"] == [{"role": "user", "content": text.strip() + "\n\n" + ASK}]
    assert text.strip() in e["prepare"]["text"]  # the rendered prompt, through the chat template
    assert e["prepare"]["text"].startswith("<|im_start|>system\n")  # SmolLM2's template adds its system turn
    reference = Tokenizer.from_file(str(smollm2.path / "tokenizer.json"))
    assert e["attach"] == {"name": "incident.txt" if source == "file" else "stdin", "chars": len(text),
                           "tokens": len(reference.encode(text.strip(), add_special_tokens=False).ids)}
    assert e["summary"]["prompt_tokens"] > e["attach"]["tokens"]


def test_a_missing_or_empty_attachment_is_a_clear_error(tmp_path):
    proc = run_cli("chat", "--file", str(tmp_path / "nope.txt"), ASK)
    assert proc.returncode == 2 and "--file" in proc.stderr and "no such file; check the path" in proc.stderr
    (tmp_path / "empty.txt").write_text("  \n")
    proc = run_cli("chat", "--file", str(tmp_path / "empty.txt"), ASK)
    assert proc.returncode == 2 and "is empty; attach a file with some text" in proc.stderr
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    proc = run_cli("chat", "--file", str(tmp_path / "bin.txt"), ASK)
    assert proc.returncode == 2 and "is not UTF-8 text" in proc.stderr


@pytest.mark.slow
def test_chat_on_a_base_model_says_to_use_run():
    proc = run_cli("chat", "-m", "gemma3-270m", "What is the capital of France?", "-n", "2", "--no-warmup")
    assert proc.returncode == 2
    assert 'use `minillm run -m gemma3-270m "..."`' in proc.stderr
    assert "ChatTemplateError" in proc.stderr and "Traceback" not in proc.stderr


def test_calibrate_measures_and_caches_this_machine(tmp_path):
    env = {"MINILLM_CACHE": str(tmp_path), "MINILLM_CALIBRATION": str(tmp_path / "calibration.json")}
    proc = run_cli("calibrate", "--threads", "1", env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for row in ("matrix-vector bandwidth", "GEMM", "disk read (cold)", "tokenizer JSON", "BLAS threads"):
        assert row in proc.stdout
    if "not kept" in proc.stdout:  # measured while other processes kept half a core busy: never cached
        assert "cores busy while measuring" in proc.stdout and not (tmp_path / "calibration.json").exists()
        return
    assert "cached in" in proc.stdout
    cached = json.loads((tmp_path / "calibration.json").read_text())
    (machine,) = cached["machines"].values()
    assert machine["fingerprint"]["blas_threads"] == 1 and machine["fingerprint"]["cores"] == os.cpu_count()
    assert machine["gemm_flop_s"] > 1e8 and machine["disk_read_b_s"] > 1e6  # measured, plausible (> 0.1 GFLOP/s)
    assert not list(tmp_path.glob(".calibrate-*"))  # the disk test's file is gone
