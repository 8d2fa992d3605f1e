"""LoRA adapters in PEFT's format: minillm's logits equal PEFT's, merged and unmerged, rsLoRA or not,
on tiny random Llama and GPT-2 models and on the real SmolLM2; unsupported adapters are refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from minillm.model import lora
from minillm.model.config import ModelConfig
from minillm.errors import AdapterError
from minillm.model.kv_cache import KVCache
from minillm.model.transformer import Transformer
from minillm.model.weights import load_weights

pytestmark = pytest.mark.reference
VOCAB = 300
TINY_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # c_proj: both attention's output and the MLP's down
}


def _tiny_hf(family: str):
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _peft_adapter(hf, folder, targets, *, r=4, alpha=8, rslora=False, seed=1, **extra):
    """Wrap ``hf`` in a PEFT LoRA with random (non-zero) A and B, seeded; save it to ``folder``."""
    import peft
    import torch

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                             init_lora_weights=False, **extra)  # False: B random too, not zeros
    model = peft.get_peft_model(hf, config).eval()
    with torch.no_grad():  # PEFT's random init is tiny; make the adapter move the logits visibly
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(4.0)
    model.save_pretrained(folder)
    return model


def _logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids[None])).logits[0].numpy()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny(request, tmp_path_factory):
    """(family, base folder, PEFT-adapted HF model per rslora flag, adapter folders)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    _tiny_hf(family).save_pretrained(root / "base")
    cases = {}
    for rslora in (False, True):
        peft_model = _peft_adapter(_tiny_hf(family), root / f"adapter-rs{int(rslora)}", TINY_TARGETS[family],
                                   r=4, alpha=8, rslora=rslora, fan_in_fan_out=family == "gpt2")
        cases[rslora] = (peft_model, root / f"adapter-rs{int(rslora)}")
    return family, root / "base", cases


def _minillm(folder, adapter_folder, merged: bool) -> Transformer:
    config = ModelConfig.from_folder(folder)
    weights = load_weights(folder, config)
    adapter = lora.load_adapter(adapter_folder, config, weights)
    if merged:
        lora.merge(adapter, weights)
    else:
        lora.activate([adapter], weights)
    return Transformer(config, weights)


@pytest.mark.parametrize("merged", [True, False], ids=["merged", "unmerged"])
@pytest.mark.parametrize("rslora", [False, True], ids=["alpha/r", "rslora"])
def test_tiny_logits_match_peft(tiny, merged, rslora, rng):
    family, base, cases = tiny
    peft_model, adapter_folder = cases[rslora]
    ids = rng.integers(0, VOCAB, size=16)
    expected = _logits(peft_model, ids)
    with peft_model.disable_adapter():
        base_logits = _logits(peft_model, ids)
    assert np.abs(expected - base_logits).max() > 1e-2  # the adapter really moves the logits

    model = _minillm(base, adapter_folder, merged)
    got = model.forward(ids)
    assert np.abs(got - expected).max() < 1e-4, f"{family} {merged=} {rslora=}: {np.abs(got - expected).max():.2e}"
    # prefill + decode through the cache take the same path
    cache = KVCache.for_model(model.config, max_seq_len=16)
    steps = [model.forward(ids[:12], cache)] + [model.forward(ids[t:t + 1], cache) for t in range(12, 16)]
    assert np.abs(np.concatenate(steps) - expected).max() < 1e-4


def test_scaling_and_summary(tiny):
    family, base, cases = tiny
    config = ModelConfig.from_folder(base)
    weights = load_weights(base, config)
    plain = lora.load_adapter(cases[False][1], config, weights)
    rs = lora.load_adapter(cases[True][1], config, weights)
    assert plain.scaling == 8 / 4 and rs.scaling == pytest.approx(8 / 2)
    assert plain.targets == sorted(TINY_TARGETS[family])
    n_modules = {"llama": 7, "gpt2": 4}[family] * config.num_hidden_layers
    assert len(plain.deltas) == n_modules
    s = plain.summary()
    assert s["parameters"] == plain.num_parameters and s["bytes"] == 4 * plain.num_parameters
    assert any("names no base model" in n for n in plain.notes)  # saved from a random model


def test_unmerged_adapters_switch_per_request(tiny, rng):
    family, base, cases = tiny
    config = ModelConfig.from_folder(base)
    weights = load_weights(base, config)
    a = lora.load_adapter(cases[False][1], config, weights)
    model = Transformer(config, weights)
    ids = rng.integers(0, VOCAB, size=8)
    base_logits = model.forward(ids)
    lora.activate([a], weights)
    assert np.abs(model.forward(ids) - _logits(cases[False][0], ids)).max() < 1e-4
    lora.activate([], weights)
    np.testing.assert_array_equal(model.forward(ids), base_logits)  # the base weights were never touched


def test_two_adapters_stack_the_same_merged_or_not(tiny, rng):
    family, base, cases = tiny
    ids = rng.integers(0, VOCAB, size=8)
    results = []
    for merged in (True, False):
        config = ModelConfig.from_folder(base)
        weights = load_weights(base, config)
        adapters = [lora.load_adapter(cases[rs][1], config, weights) for rs in (False, True)]
        if merged:
            for a in adapters:
                lora.merge(a, weights)
        else:
            lora.activate(adapters, weights)
        results.append(Transformer(config, weights).forward(ids))
    assert np.abs(results[0] - results[1]).max() < 1e-4


def test_rank_pattern_gives_a_module_its_own_rank(tmp_path, rng):
    _tiny_hf("llama").save_pretrained(tmp_path / "base")
    peft_model = _peft_adapter(_tiny_hf("llama"), tmp_path / "adapter", ["q_proj", "v_proj"], r=4,
                               rank_pattern={"v_proj": 2})
    config = ModelConfig.from_folder(tmp_path / "base")
    weights = load_weights(tmp_path / "base", config)
    adapter = lora.load_adapter(tmp_path / "adapter", config, weights)
    assert {d.module.rsplit(".", 1)[-1]: (d.rank, d.scaling) for d in adapter.deltas} == {
        "q_proj": (4, 8 / 4), "v_proj": (2, 8 / 2)}
    lora.activate([adapter], weights)
    ids = rng.integers(0, VOCAB, size=8)
    assert np.abs(Transformer(config, weights).forward(ids) - _logits(peft_model, ids)).max() < 1e-4


# --- errors ------------------------------------------------------------------------------------------
def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / lora.CONFIG_FILE).read_text())
    cfg.update(changes)
    (dst / lora.CONFIG_FILE).write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-errors")
    _tiny_hf("llama").save_pretrained(root / "base")
    _peft_adapter(_tiny_hf("llama"), root / "adapter", ["q_proj", "v_proj"])
    config = ModelConfig.from_folder(root / "base")
    return root, config, load_weights(root / "base", config)


@pytest.mark.parametrize("changes, words", [
    ({"use_dora": True}, "use_dora is set (DoRA"),
    ({"peft_type": "IA3"}, "peft_type is 'IA3'"),
    ({"bias": "all"}, "trains biases"),
    ({"alpha_pattern": {"q_proj": 16}}, "alpha_pattern"),
])
def test_unsupported_variants_are_refused(llama_base, tmp_path, changes, words):
    root, config, weights = llama_base
    folder = _copy_with_config(root / "adapter", tmp_path / "a", **changes)
    with pytest.raises(AdapterError, match=words.replace("(", r"\(")):
        lora.load_adapter(folder, config, weights)


def test_dora_saved_by_peft_is_refused(tmp_path):
    _peft_adapter(_tiny_hf("llama"), tmp_path / "dora", ["q_proj"], use_dora=True)
    _tiny_hf("llama").save_pretrained(tmp_path / "base")
    config = ModelConfig.from_folder(tmp_path / "base")
    with pytest.raises(AdapterError, match="DoRA"):
        lora.load_adapter(tmp_path / "dora", config, load_weights(tmp_path / "base", config))


def test_wrong_shape_names_the_tensor(llama_base, tmp_path):
    from safetensors.numpy import load_file, save_file

    root, config, weights = llama_base
    folder = _copy_with_config(root / "adapter", tmp_path / "a")
    tensors = load_file(folder / lora.WEIGHTS_FILE)
    bad = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[bad] = np.zeros((32, 4), np.float32)  # v_proj's out is kv_dim = 16
    save_file(tensors, folder / lora.WEIGHTS_FILE)
    with pytest.raises(AdapterError, match=rf"{bad}.*shape \(32, 4\), expected \(16, 4\)"):
        lora.load_adapter(folder, config, weights)
    # and an adapter made for a model of another size: the first mismatching tensor is named
    with pytest.raises(AdapterError, match=r"layers\.0\.self_attn\.q_proj\.lora_A\.weight"):
        lora.load_adapter(_copy_with_config(root / "adapter", tmp_path / "b", r=8), config, weights)


def test_unknown_module_and_missing_files(llama_base, tmp_path):
    from safetensors.numpy import load_file, save_file

    root, config, weights = llama_base
    with pytest.raises(AdapterError, match="does not exist"):
        lora.load_adapter(tmp_path / "nowhere", config, weights)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        lora.load_adapter(tmp_path / "empty", config, weights)
    folder = _copy_with_config(root / "adapter", tmp_path / "no-weights")
    (folder / lora.WEIGHTS_FILE).unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        lora.load_adapter(folder, config, weights)
    folder = _copy_with_config(root / "adapter", tmp_path / "head")
    tensors = load_file(folder / lora.WEIGHTS_FILE)
    tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((4, 64), np.float32)
    save_file(tensors, folder / lora.WEIGHTS_FILE)
    with pytest.raises(AdapterError, match="lm_head"):
        lora.load_adapter(folder, config, weights)


def test_another_base_model_name_is_a_note_not_an_error(llama_base, tmp_path):
    root, config, weights = llama_base
    folder = _copy_with_config(root / "adapter", tmp_path / "a", base_model_name_or_path="meta-llama/Llama-3.2-1B")
    adapter = lora.load_adapter(folder, config, weights, model_names=("tiny-llama", "/models/tiny-llama"))
    assert adapter.notes == ["adapter a was trained on 'meta-llama/Llama-3.2-1B', loaded model is tiny-llama / "
                             "/models/tiny-llama: the shapes match, so it is applied; check it is the right base model"]
    same = lora.load_adapter(folder, config, weights, model_names=("some-local-folder", "meta-llama/llama-3.2-1b"))
    assert same.notes == []


# --- the real SmolLM2 --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_adapter(smollm2, tmp_path_factory):
    """A random r=4 adapter on q_proj and v_proj of SmolLM2, made and saved by PEFT; its logits."""
    import torch
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(smollm2.path, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    folder = tmp_path_factory.mktemp("smollm2-lora") / "smollm2-random-r4"
    import peft

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = peft.get_peft_model(hf, config).eval()
    with torch.no_grad():  # PEFT's random B moves SmolLM2's logits by ~15; a "small" adapter moves them ~1.8
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.1)
    peft_model.save_pretrained(folder)
    ids = smollm2.tokenizer.encode("The capital of France is")
    adapted = _logits(peft_model, ids)
    with peft_model.disable_adapter():
        base = _logits(peft_model, ids)
    del peft_model, hf
    return folder, ids, base, adapted


@pytest.mark.slow
@pytest.mark.parametrize("merged", [True, False], ids=["merged", "unmerged"])
def test_smollm2_adapter_changes_logits_like_peft(smollm2, smollm2_adapter, merged):
    import minillm

    folder, ids, base, adapted = smollm2_adapter
    assert np.abs(adapted - base).max() > 0.1  # the adapter changes the answer's odds visibly
    tracer = minillm.Tracer()
    model = minillm.load(smollm2.path, adapters=[folder], merge_adapters=merged, tracer=tracer, warmup=False,
                         progress=False)
    got = model.transformer.forward(ids)
    # Every position's logits, 30 float32 layers: the base model alone is already up to 7.7e-5 from
    # transformers here, and with the adapter we measured up to 1.02e-4 (BLAS thread-count noise).
    assert np.abs(got - adapted).max() < 1.5e-4
    # the change itself, adapted minus base, is PEFT's (two parity errors of < 1e-4 each add up here)
    change = got - smollm2.transformer.forward(ids)
    assert np.abs(change - (adapted - base)).max() < 2e-4
    (event,) = [e for e in tracer.events if e.phase == "load"]
    (summary,) = event.data["adapters"]
    assert summary["rank"] == 4 and summary["targets"] == ["q_proj", "v_proj"]
    assert summary["mode"] == ("merged" if merged else "unmerged")
    assert summary["parameters"] == 30 * 4 * ((576 + 576) + (576 + 192))  # A [4, 576], B [out, 4]
    if merged:
        with pytest.raises(AdapterError, match="merged into the weights"):
            model.set_active_adapters([])
    else:
        assert model.active_adapters == ["smollm2-random-r4"]
        model.set_active_adapters([])
        assert model.active_adapters == []
        np.testing.assert_allclose(model.transformer.forward(ids), smollm2.transformer.forward(ids), atol=1e-5)
        with pytest.raises(AdapterError, match="no adapter named"):
            model.set_active_adapters(["other"])


@pytest.mark.slow
def test_cli_runs_with_an_adapter(smollm2, smollm2_adapter, capsys):
    from minillm.cli import main

    folder = smollm2_adapter[0]
    status = main(["run", "The capital of France is", "-n", "2", "-m", str(smollm2.path), "--adapter", str(folder),
                   "--adapter-mode", "unmerged", "-v", "summary", "--no-warmup"])
    out = capsys.readouterr().out
    assert status == 0
    assert "LoRA adapter smollm2-random-r4 (unmerged)" in out and "q_proj, v_proj in 30 layers" in out
