"""The speed benchmark's arithmetic and report shape (no timing assertions: timings are noise here).

The real benchmark is ``python -m benchmarks.speed``; this only checks that its ceilings and
targets compute what benchmarks/speed.py says, and that a tiny in-process run writes the JSON
the notebooks read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/ is not installed
from benchmarks import speed  # noqa: E402


# --- ceilings and targets, exact values ----------------------------------------------------------
def test_decode_ceiling_is_bandwidth_over_bytes_per_token():
    # 16-token prompt, 128 new tokens: 127 decode steps reading 17..143 cached positions, mean 80.
    assert speed.mean_decode_context(16, 128) == 80.0
    assert speed.mean_decode_context(16, 2) == 17.0
    per_token = speed.decode_bytes_per_token(matmul_parameters=1_000, kv_bytes_per_token=10, context=80)
    assert per_token == 1_000 * 4 + 10 * 80 == 4_800
    assert speed.decode_ceiling(48_000.0, per_token) == 10.0


def test_prefill_ceiling_is_two_flops_per_parameter():
    assert speed.prefill_ceiling(2e9, parameters=1_000_000) == 1_000.0


def test_rss_budget_is_weights_plus_kv_plus_a_quarter():
    assert speed.rss_budget(800, 200) == 1_250.0


def test_medians_and_ratios_tolerate_missing_figures():
    assert speed.median([3.0, 1.0, 2.0]) == 2.0
    assert speed.median([]) is None
    assert speed.ratio(3.0, 2.0) == 1.5
    assert speed.ratio(None, 2.0) is None and speed.ratio(1.0, None) is None and speed.ratio(1.0, 0) is None


def test_summary_ratios_and_targets_from_known_runs():
    runs = {
        "minillm": {"load_s": [1.0, 3.0, 1.5], "prefill": {"512": {"seconds": [1.0, 2.0, 0.5]}},
                    "decode": {"new_tokens": 11, "seconds": [0.5, 1.0, 2.0], "step_ms_median": [50.0]},
                    "weights_pass": {"seconds": [0.04, 0.05, 0.08], "bytes": 4_000},
                    "peak_rss_bytes": 1_000 * 2**20},
        "torch-eager": {"load_s": [2.0], "prefill": {"512": {"seconds": [4.0]}},
                        "decode": {"new_tokens": 11, "seconds": [2.0], "step_ms_median": [200.0]},
                        "peak_rss_bytes": 2_000 * 2**20},
        "torch-sdpa": {"load_s": [2.0], "prefill": {"512": {"seconds": [1.0]}},
                       "decode": {"new_tokens": 11, "seconds": [1.0], "step_ms_median": [100.0]},
                       "peak_rss_bytes": 2_000 * 2**20},
    }
    figures = {name: speed.summarise_runtime(r) for name, r in runs.items()}
    mine = figures["minillm"]
    assert mine["load_s"] == 1.5
    assert mine["prefill_tokens_per_s"] == {"512": 512.0}  # median of 512, 256, 1024 tokens/s
    assert mine["decode_tokens_per_s"] == 10.0  # (11 - 1) new tokens in a median 1.0 s
    assert mine["decode_step_ms"] == 100.0
    assert mine["weights_pass_tokens_per_s"] == 20.0  # median of 25, 20, 12.5 passes/s
    assert figures["torch-eager"]["weights_pass_tokens_per_s"] is None
    fastest = speed.summarise_runtime(runs["minillm"], "best")
    assert (fastest["load_s"], fastest["prefill_tokens_per_s"], fastest["decode_tokens_per_s"]) == (1.0, {"512": 1024.0}, 20.0)
    ceilings = {"decode_tokens_per_s": 20.0, "prefill_tokens_per_s": 1024.0}
    ratios = speed.compute_ratios(figures, ceilings)
    assert ratios["minillm/torch-eager"]["decode_tokens_per_s"] == 2.0
    assert ratios["minillm/torch-sdpa"]["prefill_tokens_per_s"] == {"512": 1.0}
    assert ratios["minillm/ceiling"]["decode_tokens_per_s"] == 0.5
    assert ratios["minillm/ceiling"]["weights_pass_tokens_per_s"] == 1.0  # 20 / 20
    assert ratios["minillm/weights-pass"]["decode_tokens_per_s"] == 0.5  # 10 / 20
    targets = {t["name"]: t["passed"] for t in speed.evaluate_targets(
        figures, ratios, {"weights_bytes": 700 * 2**20, "kv_bytes": 100 * 2**20})}
    assert targets == {
        "decode tokens/s vs torch eager": True,  # 2.0 >= 1.3
        "decode tokens/s vs bandwidth ceiling": False,  # 0.5 < 0.75
        "prefill tokens/s at 512 vs torch sdpa": True,  # 1.0 >= 1.0
        "decode tokens/s vs the matrix products alone": False,  # 0.5 < 0.9
        "warm load": True,  # 1.5 s <= 2 s
        "peak RSS": True,  # 1,000 MiB <= (700 + 100) x 1.25
    }


# --- the report's shape, from a tiny in-process run ----------------------------------------------
def tiny_llama_folder(path):
    """A 2-layer random Llama in a Hugging Face-style folder, written with NumPy only."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab, d, ffn, layers, heads, kv_heads = 64, 32, 64, 2, 4, 2
    head_dim = d // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
              "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": 128,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": vocab, "hidden_act": "silu",
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    rng = np.random.default_rng(0)
    w = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(vocab, d), "model.norm.weight": np.ones(d, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
            p + "self_attn.q_proj.weight": w(heads * head_dim, d),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, d),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, d),
            p + "self_attn.o_proj.weight": w(d, heads * head_dim),
            p + "mlp.gate_proj.weight": w(ffn, d), p + "mlp.up_proj.weight": w(ffn, d),
            p + "mlp.down_proj.weight": w(d, ffn),
        })
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    folder = tiny_llama_folder(tmp_path_factory.mktemp("tiny-llama"))
    out = tmp_path_factory.mktemp("bench") / "speed.json"
    report = speed.main([
        "--quick", "--in-process", "--silent", "--runtimes", "minillm", "--model", str(folder),
        "--json", str(out), "--repeats", "1", "--prompt-lengths", "4", "8", "--new-tokens", "4",
        "--bandwidth-mib", "4", "--gemm-n", "64", "--curves", "--curve-lengths", "1", "4",
        "--curve-max-ctx", "6", "--curve-nocache-ctx", "1", "6",
    ])
    return report, json.loads(out.read_text())


def test_quick_run_writes_the_report_it_returns(quick_report):
    report, written = quick_report
    assert set(speed.REPORT_KEYS) <= set(written)
    assert written["schema"] == speed.SCHEMA
    assert written["figures"] == json.loads(json.dumps(report["figures"]))


def test_quick_run_figures_ceilings_and_targets(quick_report):
    _, r = quick_report
    mine = r["figures"]["minillm"]
    assert set(r["figures"]) == {"minillm"}
    assert set(mine["prefill_tokens_per_s"]) == {"4", "8"}
    assert all(v > 0 for v in mine["prefill_tokens_per_s"].values())
    assert mine["decode_tokens_per_s"] > 0 and mine["load_s"] > 0 and mine["peak_rss_bytes"] > 0
    assert r["machine"]["read_gb_s"] > 0 and r["machine"]["gemm_gflop_s"] > 0
    model = r["runtimes"]["minillm"]["model"]
    assert model["dtypes"] == ["float32"]
    # 2 layers x (qkv 64x32 + o 32x32 + gate|up 128x32 + down 32x64) + the tied head 64x32, float32
    assert model["matmul_parameters"] == 2 * (2_048 + 1_024 + 4_096 + 2_048) + 2_048 == 20_480
    assert r["runtimes"]["minillm"]["weights_pass"]["bytes"] == 4 * 20_480
    assert mine["weights_pass_tokens_per_s"] > 0
    assert r["ceilings"]["decode_bytes_per_token"] == speed.decode_bytes_per_token(
        model["matmul_parameters"], model["kv_bytes_per_token"], speed.mean_decode_context(16, 4))
    targets = {t["name"]: t["passed"] for t in r["targets"]}
    assert targets["decode tokens/s vs torch eager"] is None  # torch was not run
    # the warm-load target is judged on the measured load time against the 2 s budget, whatever it was
    assert targets["warm load"] is (mine["load_s"] <= speed.LOAD_MAX_S)


def test_quick_run_reports_blas_and_openblas_env(quick_report):
    _, r = quick_report
    for worker in r["workers"]:
        assert set(worker["env"]) == {"OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"}
        assert isinstance(worker["blas"], list)
        assert worker["contention"]["others_cpu_share"] >= 0
    assert any(pool.get("user_api") == "blas" for w in r["workers"] for pool in w["blas"])


def test_quick_run_curves_for_the_notebooks(quick_report):
    _, r = quick_report
    c = r["curves"]
    assert c["prefill_vs_length"]["length"] == [1, 4] and len(c["prefill_vs_length"]["seconds"]) == 2
    assert c["decode_with_cache"]["ctx"] == [2, 3, 4, 5, 6]
    assert len(c["decode_with_cache"]["seconds"]) == 5
    assert c["decode_without_cache"]["ctx"] == [1, 6] and len(c["decode_without_cache"]["seconds"]) == 2


def test_quick_run_renders(quick_report):
    import io

    from rich.console import Console

    from benchmarks.report import render

    buffer = io.StringIO()
    render(quick_report[0], Console(file=buffer, width=160))
    text = buffer.getvalue()
    assert "decode (tok/s)" in text and "targets (issue 6)" in text and "OPENBLAS_CORETYPE" in text


def test_the_default_report_path_is_untracked():
    """A plain run (``--quick`` included) writes under benchmarks/results/local/, which .gitignore
    lists, never over the committed benchmarks/results/speed.json."""
    root = Path(__file__).resolve().parent.parent
    args = speed.parse_args(["--quick"])
    assert args.json == root / "benchmarks" / "results" / "local" / "speed.json"
    assert "benchmarks/results/local/" in (root / ".gitignore").read_text().splitlines()
    assert speed.parse_args(["--json", "x.json"]).json == Path("x.json")  # told otherwise: there
